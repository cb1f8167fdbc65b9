"""The fine-tuning stages: conversations, NVLM tiling, token counts, padding and packing."""
