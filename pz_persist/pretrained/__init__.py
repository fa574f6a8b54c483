"""Pretrained weights into Penzai models and back: Gemma (official Flax
checkpoints), Hugging Face folders (Llama, Mistral, Qwen2, Gemma, Gemma 2,
GPT-NeoX) read with pz_persist's own safetensors parser and written back by
`export_hf`, and safetensors files exported by pz_persist.

The library never downloads anything: fetch the files in your own code (e.g.
``huggingface_hub.snapshot_download``, ``kagglehub.model_download``), then load
them here. Convert once with ``pz-persist convert`` and reload the native
checkpoint with `pz_persist.load_model` for the fast path.
"""

from pz_persist.pretrained.gemma import GemmaReport
from pz_persist.pretrained.gemma import GemmaSetting
from pz_persist.pretrained.gemma import load_gemma
from pz_persist.pretrained.hf import load_hf
from pz_persist.pretrained.hf.export import export_hf
from pz_persist.pretrained.lora_merge import merge_lora
from pz_persist.pretrained.safetensors_io import export_safetensors
from pz_persist.pretrained.safetensors_io import load_safetensors
from pz_persist.pretrained.sampling import kv_caching_lm

__all__ = ["GemmaReport", "GemmaSetting", "export_hf", "export_safetensors", "kv_caching_lm",
           "load_gemma", "load_hf", "load_safetensors", "merge_lora"]
