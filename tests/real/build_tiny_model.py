"""Build a tiny random Llama and a locally trained tokenizer (no model hub is reachable).

Run by the vLLM venv's interpreter (it has ``transformers`` and ``tokenizers``):
``python build_tiny_model.py OUT_DIR``. Writes a Hugging Face folder ``vllm serve OUT_DIR``
loads: ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``...
Shape: 2 layers, hidden 128, 2 heads of size 64 (vLLM's CPU attention supports head sizes
32, 64, 80, ...), vocab 1024, bfloat16, seed 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 1024

_TEXT = (
    "an inference server schedules requests, runs a forward step for a batch and streams tokens.",
    "when a rank hangs inside a collective its peers wait for it and the engine stops making progress.",
    "servewatch captures the stacks of every process of the server and names the rank that hangs.",
    "0 1 2 3 4 5 6 7 8 9 10 64 128 256 1024 , . ; : ! ? ' \" ( ) [ ] { } < > / - + = _",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz hello world",
)


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_TEXT) * 16, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=512
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=max(VOCAB, len(fast)),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
