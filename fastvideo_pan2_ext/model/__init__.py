"""PAN2, the model: its transformer's definition (`architecture`, torch-free), the transformer as a FastVideo DiT
(`transformer`, `dit_config`) and its Qwen3.5 text encoder for FastVideo's loader (`text_encoder`)."""
