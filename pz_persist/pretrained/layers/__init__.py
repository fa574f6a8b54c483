"""Penzai layers the pretrained loaders add where Penzai's own architectures
lack a piece a published model needs (scaled rotary embeddings, ...).

Each is a small ``pz.nn.Layer`` dataclass, rendered by treescope like
Penzai's own, and allow-listed for `pz_persist.save_model` /
`pz_persist.load_model` (`pz_persist.safety.allowlist.DEFAULT_ALLOWED_MODULES`).
"""
