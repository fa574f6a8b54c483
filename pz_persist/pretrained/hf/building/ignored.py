"""Reasons several records give for a ``config.json`` field their plans
leave unread (`pz_persist.pretrained.hf.record.ModelType.ignored_fields`),
written once."""

OTHER_MODALITIES = "the other modalities' towers and tokens: a text-only model never sees them"
"""Why a multimodal folder's own config (``gemma3``, ``gemma4``, ``llama4``,
``qwen3_5``...) leaves its vision and audio fields unread: pz_persist builds
the text model only, and reports the towers' tensors it leaves."""
