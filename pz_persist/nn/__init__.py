"""Penzai layers pz_persist adds where Penzai's own architectures lack a
piece a published model needs (scaled rotary embeddings, mixture of experts,
latent attention, ...).

Each is a small ``pz.nn.Layer`` dataclass, rendered by treescope like
Penzai's own, and allow-listed for `pz_persist.save_model` /
`pz_persist.load_model` (`pz_persist.safety.allowlist.DEFAULT_ALLOWED_MODULES`).
A checkpoint names each class by its module path and qualname, so this
package is their lasting home: a class that moves keeps loading under its
former name through the recorded aliases of the format.
"""
