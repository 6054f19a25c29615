"""Tiny random models of each supported architecture, built from a config (nothing downloaded)."""
import torch


def tiny_config(arch: str = "llama", vocab: int = 64, layers: int = 2, hidden: int = 32, heads: int = 4,
                kv_heads: int = 2, **extra):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    common.update(extra)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
           "mistral": tf.MistralConfig}[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", hidden // heads)
    cfg = cls(**common)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "mistral": "MistralForCausalLM"}[arch]]
    return cfg


def tiny_model(arch: str = "llama", seed: int = 0, scale: float = 1.0, **kw):
    """A random model; `scale` multiplies the LM head so distributions are peaked (scale > 1) or flat."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw), attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
        model.lm_head.weight.mul_(scale)
    return model.eval().requires_grad_(False)
