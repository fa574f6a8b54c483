"""The building blocks the Hugging Face family records
(`pz_persist.pretrained.hf.families`) are made of: no module here is a
family, and none names a family's ``model_type`` as its own.

- `decoder`: the llama-like decoder most families build on (`llama_plan`
  with its hooks, biases, scaled RoPE, the sizes written back).
- `norms`: per-head query/key norms and Gemma's offset norms;
  `post_norms`: OLMo's norms after each branch.
- `qwen_windows`: Qwen's per-layer sliding windows.
- `hunyuan`: Hunyuan's attention (query/key norms after RoPE, ``alpha`` RoPE),
  dense and mixture of experts.
- `gemma_layout`: Gemma 2's activation check and written fields (Gemma 3, 4).
- `hybrid_decoder`: Qwen3.5's gated DeltaNet and gated-attention layers
  (dense and mixture of experts).
- `moe`: mixtures of experts on the shared `pz_persist.nn.mixture_of_experts`
  (softmax routers, experts stacked on an axis, the config fields);
  `deepseek_moe`, `gpt_oss_moe`, `llama4_moe`, `gemma4_moe`: the routers and
  experts particular to those models.
- `defaults`: the rows of transformers' defaults that several families share;
  `ignored`: the reasons several records give for fields they leave unread.
"""
