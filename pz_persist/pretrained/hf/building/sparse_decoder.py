"""DeepSeek Sparse Attention decoders (shared code, no record): DeepSeek-V3's
layout (`pz_persist.pretrained.hf.building.latent_decoder`) with a lightning
indexer (`pz_persist.nn.sparse_attention`), as DeepSeek-V3.2
(``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) lay it out: dense layers
where ``mlp_layer_types`` says, ``layer_types`` all ``"indexed_attention"``,
the indexer's sizes checked against the attention's, the fields export
writes for both. What differs (the indexer's RoPE, GLM-5's layers that
reuse an earlier layer's choice) is each family's.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from penzai import pz

from pz_persist.nn import latent_attention as mla
from pz_persist.nn import sparse_attention as dsa
from pz_persist.pretrained.hf.building.deepseek_moe import routing_fields
from pz_persist.pretrained.hf.building.latent_decoder import FIELDS
from pz_persist.pretrained.hf.building.latent_decoder import IndexerSizes
from pz_persist.pretrained.hf.building.latent_decoder import Sizes
from pz_persist.pretrained.hf.building.latent_decoder import first_k_dense
from pz_persist.pretrained.hf.building.latent_decoder import latent_fields
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.record import Field

_KINDS = ("dense", "sparse")
INDEXED = "indexed_attention"


def _mlp_kinds(value: Any) -> bool:
  return isinstance(value, list) and all(kind in _KINDS for kind in value)


def _attention_kinds(value: Any) -> bool:
  return isinstance(value, list) and all(isinstance(kind, str) for kind in value)


SPARSE_FIELDS: dict[str, Field] = {
    **FIELDS, "mlp_layer_types": (_mlp_kinds, 'a list of "dense" / "sparse"'),
    "layer_types": (_attention_kinds, 'a list of "indexed_attention"'),
    "index_topk": POSITIVE_INT, "index_head_dim": POSITIVE_INT, "index_n_heads": POSITIVE_INT,
}
"""The ``config.json`` fields both families read beyond the shared ones."""


def per_layer(cfg: Config, key: str, layers: int) -> Sequence[Any] | None:
  """``key``'s list, refused unless it has one entry per layer."""
  given = cfg.get(key)
  if given is not None and len(given) != layers:
    raise cfg.unsupported(key, f"a list of {len(given)}",
                          f"needs one entry per layer (num_hidden_layers={layers})")
  return given


def dense_layers(cfg: Config, layers: int) -> Callable[[int], bool]:
  """Whether layer ``i`` is dense: as ``mlp_layer_types`` says, else (as
  transformers derives that list) the first ``first_k_dense_replace``."""
  given = per_layer(cfg, "mlp_layer_types", layers)
  first_k = first_k_dense(cfg, layers)  # Read either way: transformers' class holds it.
  if given is None:
    return first_k
  dense = frozenset(i for i, kind in enumerate(given) if kind == "dense")
  return lambda i: i in dense


def read_indexer(cfg: Config, sizes: Sizes, title: str) -> IndexerSizes:
  """The lightning indexer's sizes, checked against the attention's; and
  what transformers' ``title`` class fixes that DeepSeek-V3 lets a config
  choose (its RoPE, ``rope_interleave`` absent, always interleaved)."""
  kinds = per_layer(cfg, "layer_types", sizes.layers)
  if kinds is not None and any(kind != INDEXED for kind in kinds):
    other = next(kind for kind in kinds if kind != INDEXED)
    raise cfg.unsupported("layer_types", other, f"every {title} layer is {INDEXED!r}"
                          " (the indexer's sparse attention); no other kind is built")
  if not sizes.interleave:
    raise cfg.unsupported("rope_interleave", False, f"transformers' {title} always reads"
                          " the rotary numbers interleaved; drop the field")
  if cfg.get("mlp_bias", FROM_TABLE):
    raise cfg.unsupported("mlp_bias", True, f"transformers' {title} MLPs have no biases")
  if sizes.q_rank is None:
    raise cfg.unsupported("q_lora_rank", None, f"{title}'s indexer reads its queries"
                          " from the low-rank query latent, which it must have")
  dim = cfg.get("index_head_dim", FROM_TABLE)
  if dim < sizes.rope:
    raise cfg.unsupported("index_head_dim", dim, f"the indexer rotates its first"
                          f" qk_rope_head_dim={sizes.rope} numbers: it must be at least that")
  return IndexerSizes(heads=cfg.get("index_n_heads", FROM_TABLE), dim=dim,
                      top_k=cfg.get("index_topk", FROM_TABLE))


def indexer_interleaved(model: pz.nn.Layer) -> bool | None:
  """Whether ``model``'s (first) lightning indexer rotates interleaved
  pairs (GLM-5) or halves (DeepSeek-V3.2); None without an indexer."""
  if not all_layers(model, dsa.IndexedQuery):
    return None
  query = first_layer(model, dsa.IndexedQuery, "indexer query").index_query
  return bool(all_layers(query, mla.Deinterleave))


def sparse_fields(model: pz.nn.Layer, like: Mapping[str, Any]) -> tuple[dict[str, Any], list[bool]]:
  """The fields of a DeepSeek Sparse Attention model (both families'), and
  which of its blocks are dense."""
  fields, dense = latent_fields(model, like)
  fields.update(routing_fields(model, like, sum(dense)))
  sparse = first_layer(model, dsa.SparseAttentionLogits, "sparse attention")
  index_query = first_layer(model, dsa.IndexedQuery, "indexer query").index_query
  query = named_shape(first_layer(index_query, pz.nn.Linear, "indexer query"))
  del fields["rope_interleave"]  # Not a field of transformers' classes: always interleaved.
  fields.update({
      "index_topk": sparse.top_k, "index_n_heads": query["index_heads"],
      "index_head_dim": query["projection"],
      "mlp_layer_types": [_KINDS[0] if d else _KINDS[1] for d in dense],
      "layer_types": [INDEXED] * len(dense), "mlp_bias": False,
  })
  prefix = sum(dense)
  if dense == [True] * prefix + [False] * (len(dense) - prefix):
    fields["first_k_dense_replace"] = prefix
  else:  # transformers reads mlp_layer_types; a first_k that disagrees would mislead.
    fields["first_k_dense_replace"] = like.get("first_k_dense_replace", 0)
  if "num_nextn_predict_layers" not in like:
    del fields["num_nextn_predict_layers"]
  return fields, dense
