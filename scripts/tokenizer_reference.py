"""Token ids for a few strings from Hugging Face transformers' GGUF tokenizer conversion, an
implementation independent of pipeshard's. Usage: python3 tokenizer_reference.py SMOLLM2.gguf QWEN.gguf
(pip install transformers gguf) > crates/cli/tests/data/tokenizer_reference.json"""
import json, sys, types, importlib.machinery
# transformers' GGUF reader imports torch for dtype constants only; the tokenizer path never
# touches it, so a stand-in module lets it load without the (multi-GB) torch wheel.
fake = types.ModuleType("torch"); fake.float32 = fake.float16 = fake.bfloat16 = object()
fake.__getattr__ = lambda name: object
fake.__spec__ = importlib.machinery.ModuleSpec("torch", None); fake.__version__ = "0.0"
sys.modules["torch"] = fake
from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer, convert_gguf_tokenizer
strings = [
    "The capital of France is",
    "Hello, world! 12345 + 678 = 13023",
    "naïve café — 日本語のテキスト 🚀🔥 Ωμέγα",
    "def f(x):\n    return x  *  2\n\n\n\tprint('a\\tb')",
    "   leading spaces and trailing   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm can't they'll WE'VE 3.14159 1,000,000",
]
out = {}
for name, path in [("smollm2", sys.argv[1]), ("qwen2", sys.argv[2])]:
    arch, tdict, tconf = get_gguf_tokenizer(path)
    fast, extra = convert_gguf_tokenizer(arch, tdict)
    if name == "smollm2":
        # transformers' GGUF converter drops SmolLM2's digit splitting (`tokenizer.ggml.pre` =
        # smollm); restore the pre-tokenizer of SmolLM2's own tokenizer.json, which llama.cpp's
        # smollm pre-tokenizer also implements: digits isolated, then GPT-2 byte-level.
        from tokenizers import pre_tokenizers
        fast.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    out[name] = [{"text": s, "ids": fast.encode(s, add_special_tokens=False).ids} for s in strings]
print(json.dumps(out, ensure_ascii=False, indent=1))
