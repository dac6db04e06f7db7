"""Shared fixtures: tiny random-weight HF models saved to temporary folders.

Every folder holds config.json, model.safetensors (float32) and a byte-level BPE fast tokenizer
(trained offline on a few sentences) with ChatML special tokens and chat template; the model's
vocab_size equals the tokenizer's. Nothing is downloaded.

    tiny_llama_dir     Llama, GQA (4 heads / 2 KV heads), hidden 64, 3 layers
    tiny_qwen2_dir     Qwen2ForCausalLM: qkv bias, tied embeddings
    tiny_llama3_dir    Llama with llama3 rope scaling
    tiny_mixtral_dir, tiny_qwen2_moe_dir, tiny_qwen3_moe_dir   mixtures of experts (MOE_MODELS)
    tiny_phi3_dir      Phi3ForCausalLM: fused qkv_proj / gate_up_proj checkpoint tensors
    tiny_phi3_longrope_dir   Phi-3 with LongRoPE (original context 56 of 512)
    tiny_phi4_mini_dir Phi-4-mini's shape: LongRoPE, partial rotary (half of each head), tied
    make_tiny_model    factory: make_tiny_model("name", arch="llama", **config_overrides) -> Path
    default_model_dir  the default GGUF model converted once per session (slow: ~15 s)
"""

from __future__ import annotations

import os as _os

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. Triton must
# see this before anything imports it: some test modules import triton while being collected
# (pytest.importorskip), before tests/engine/conftest.py, and a kernel defined against the
# other mode then fails mid-suite ("Cannot call @triton.jit'd outside of the scope of a kernel").
if not _os.path.exists("/dev/nvidiactl"):
    _os.environ.setdefault("TRITON_INTERPRET", "1")

# Under `make test` several pytest workers compute at once (pytest-xdist): each gets one torch /
# OpenMP thread, and the servers and workers it starts inherit it, so two workers fill two cores
# instead of four threads fighting over them. Tests that need two threads set them.
if _os.environ.get("PYTEST_XDIST_WORKER"):
    _os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every engine the tests build (in process, in servers, in workers) sizes its KV cache from
# this, not from a share of RAM: on the CPU a cache is committed at start-up (host_memory), and
# the default share (gigabytes an engine, for a tiny model) spent most of some files' time
# zeroing pages. Tests that size caches themselves pass num_kv_blocks / kv_cache_memory.
_os.environ.setdefault("TESSERA_KV_CACHE_MEMORY", "512MiB")

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# pytest puts this folder first on sys.path, where tests/engine (no __init__.py) would shadow
# the real `engine` package when the repo root is not on the path (e.g. `.venv/bin/pytest`).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def pytest_collection_modifyitems(config, items) -> None:
    """Files with `slow` tests first (each file's own order kept): under `make test` the
    workers take whole files (xdist's loadfile) in this order, so the long ones start early
    and the run does not end on one worker alone with a slow file. Tests marked `cuda` need
    a CUDA device: skipped (not failed) where there is none."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in marked:
        item.add_marker(skip)


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
_CORPUS = [
    "The capital of France is Paris. Paris is a city on the Seine.",
    "Hello world! This is a tiny tokenizer for tests of a serving engine.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Tessera serves language models with a paged key value cache.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Café, naïve, 東京, emoji 🙂.",
    "What is the capital of France? The answer is Paris, of course.",
    "user assistant system: you are a helpful assistant. Be brief.",
]


def build_tokenizer(
    out_dir: Path,
    vocab_size: int = 384,
    corpus: list[str] | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
    bos_token: str = "<|im_start|>",
    added_tokens: tuple[str, ...] = (),
):
    """Train a byte-level BPE on `corpus` (default _CORPUS) and save it as a HF fast
    tokenizer in out_dir, with the ChatML special tokens, `added_tokens` (whole tokens that
    are not special: decoding keeps them, as Qwen3's <think>) and `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.add_tokens(list(added_tokens))
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    tokenizer: dict | None = None,
    **overrides,
) -> Path:
    """Save a tiny random model of arch ("llama", "qwen2", "qwen3", "phi3", or the mixtures of
    experts "mixtral", "qwen2_moe", "qwen3_moe") with its tokenizer in out_dir.

    Weights are drawn wider than HF's default init (and norms/biases are randomised too) so
    logits are peaked: greedy decoding then has clear margins, and every weight matters.
    `tokenizer`: build_tokenizer's arguments (a chat template, special tokens).
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, **(tokenizer or {}))
    kwargs = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    kwargs.update(overrides)
    import transformers

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    }[arch]
    if isinstance(config_cls, str):
        config_cls, model_cls = getattr(transformers, config_cls), getattr(transformers, model_cls)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias
                p.normal_(0.0, 0.1)
            elif name.endswith(".sinks"):  # gpt-oss: large enough to move the attention
                p.normal_(0.0, 1.0)
    model.save_pretrained(str(out_dir))
    return out_dir


def private_cache_dir(path: Path, monkeypatch=None) -> Path:
    """`path` as a TESSERA_CACHE_DIR for models (set with `monkeypatch` where given), with this
    machine's compiled CPU kernels linked in: they are keyed by their sources, so the library
    is the one a process using `path` would build, and the processes started from here (TP
    ranks, servers) do not each compile it again (~20 s of CPU)."""
    from engine.kernels.cpu import ops
    from engine.paths import default_cache_dir

    ops.library()  # built (or found) in the usual cache first
    kernels = default_cache_dir() / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    if kernels.is_dir() and not (path / "kernels").exists():
        (path / "kernels").symlink_to(kernels, target_is_directory=True)
    if monkeypatch is not None:
        monkeypatch.setenv("TESSERA_CACHE_DIR", str(path))
    return path


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Tests that run several ranks in this process give torch one thread; the next test gets
    the count back (torch is not imported here for tests that never load it)."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory) -> Callable[..., Path]:
    made: dict[tuple, Path] = {}

    def make(name: str, arch: str = "llama", **overrides) -> Path:
        # keyed by everything that shapes the model: two files asking for one name with other
        # sizes get two models (a worker runs many files; the first caller's must not win)
        key = (name, arch, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = build_tiny_model(tmp_path_factory.mktemp(name), arch, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model) -> Path:
    return make_tiny_model("tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(make_tiny_model) -> Path:
    return make_tiny_model("tiny-qwen2", arch="qwen2", tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def genconf_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with sampling defaults in its generation_config.json (greedy, top-k 5,
    5 new tokens; do_sample, which vLLM does not read, too)."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("genconf") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    defaults = {"temperature": 0.0, "top_k": 5, "max_new_tokens": 5, "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **defaults}))
    return folder


# A reasoning model's template: the generation prompt opens the think section (DeepSeek-R1's
# way), unless chat_template_kwargs' enable_thinking is false, which closes an empty one (Qwen3's).
REASONING_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}",
)


@pytest.fixture(scope="session")
def tiny_reasoning_dir(make_tiny_model) -> Path:
    """A tiny Llama whose tokenizer has <think> and </think> as whole tokens (the last two
    ids) and whose template opens the think section (REASONING_TEMPLATE)."""
    tokenizer = dict(chat_template=REASONING_TEMPLATE, added_tokens=("<think>", "</think>"))
    return make_tiny_model("tiny-reasoning", tokenizer=tokenizer, seed=5)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(make_tiny_model) -> Path:
    """Qwen3: q/k normalized per head, heads wider than hidden / heads (32 against 16)."""
    return make_tiny_model("tiny-qwen3", arch="qwen3", head_dim=32, seed=3)


# Mixtures of experts: 8 or 16 experts of width 32, several tokens per step on each expert and
# some on none; Qwen3-MoE keeps its layer 1 dense (mlp_only_layers), Qwen2-MoE has a shared
# expert and top-k weights left unnormalized.
MOE_MODELS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, seed=4),
    "qwen2_moe": dict(
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        seed=5,
    ),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        head_dim=32,
        seed=6,
    ),
}


@pytest.fixture(scope="session")
def tiny_mixtral_dir(make_tiny_model) -> Path:
    return make_tiny_model("tiny-mixtral", arch="mixtral", **MOE_MODELS["mixtral"])


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(make_tiny_model) -> Path:
    return make_tiny_model("tiny-qwen2-moe", arch="qwen2_moe", **MOE_MODELS["qwen2_moe"])


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(make_tiny_model) -> Path:
    return make_tiny_model("tiny-qwen3-moe", arch="qwen3_moe", **MOE_MODELS["qwen3_moe"])


# Sliding-window models, window 16 (one block): Mistral windows every layer (the KV cache
# frees blocks behind it); Qwen2 with use_sliding_window windows layers >= max_window_layers
# (1 here: layer 0 global, a hybrid model that keeps every block), or all of them (0).
SLIDING_WINDOW = 16


@pytest.fixture(scope="session")
def tiny_mistral_sw_dir(make_tiny_model) -> Path:
    return make_tiny_model("tiny-mistral-sw", arch="mistral", sliding_window=SLIDING_WINDOW, seed=7)


@pytest.fixture(scope="session")
def tiny_qwen2_sw_dir(make_tiny_model) -> Path:
    return make_tiny_model(
        "tiny-qwen2-sw",
        arch="qwen2",
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        max_window_layers=1,
        seed=8,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_all_sw_dir(make_tiny_model) -> Path:
    return make_tiny_model(
        "tiny-qwen2-all-sw",
        arch="qwen2",
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        max_window_layers=0,
        tie_word_embeddings=True,
        seed=9,
    )


@pytest.fixture(scope="session")
def tiny_mixtral_sw_dir(make_tiny_model) -> Path:
    """Mixtral with a window on every layer (the KV cache frees behind it)."""
    moe = {**MOE_MODELS["mixtral"], "sliding_window": SLIDING_WINDOW}
    return make_tiny_model("tiny-mixtral-sw", arch="mixtral", **moe)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_sw_dir(make_tiny_model) -> Path:
    """Qwen2-MoE with use_sliding_window: transformers' default windows its even layers below
    max_window_layers (layers 0 and 2 of 3 here: a hybrid model)."""
    moe = {**MOE_MODELS["qwen2_moe"], "use_sliding_window": True}
    moe |= {"sliding_window": SLIDING_WINDOW, "max_window_layers": 3}
    return make_tiny_model("tiny-qwen2-moe-sw", arch="qwen2_moe", **moe)


@pytest.fixture(scope="session")
def tiny_llama3_dir(make_tiny_model) -> Path:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return make_tiny_model("tiny-llama3", rope_theta=500000.0, rope_scaling=scaling, seed=2)


def longrope_scaling(rotary_dim: int, original: int, seed: int = 0) -> dict:
    """A "longrope" rope_scaling: short factors near 1, long ones up to 16 (Phi-3's shape)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = rotary_dim // 2
    short = (1.0 + 0.5 * torch.rand(n, generator=g)).tolist()
    long = (1.0 + 15.0 * torch.linspace(0, 1, n) ** 2).tolist()
    return {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": original,
    }


@pytest.fixture(scope="session")
def tiny_gemma3_dir(make_tiny_model) -> Path:
    """Gemma 3 (text): GeGLU, four norms a layer, q/k norms, query_pre_attn_scalar other than
    head_dim, local and global layers alternating (pattern 2) with their own rope bases, the
    global ones linearly scaled; tied embeddings, logits soft-capped."""
    return make_tiny_model(
        "tiny-gemma3",
        arch="gemma3",
        seed=8,
        head_dim=16,
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=16,  # the prompts and their generation run past it on the local layers
        sliding_window_pattern=2,
        rope_local_base_freq=10000.0,
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
        final_logit_softcapping=30.0,
    )


# gpt-oss: attention sinks and biases, yarn rope, layers alternating window 16 / global, 8
# experts top-2 with biases and the clamped SwiGLU, the router's bias.
GPT_OSS = dict(
    seed=9,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=32,
    sliding_window=16,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
    },
)


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(make_tiny_model) -> Path:
    return make_tiny_model("tiny-gpt-oss", arch="gpt_oss", **GPT_OSS)


@pytest.fixture(scope="session")
def tiny_phi3_dir(make_tiny_model) -> Path:
    return make_tiny_model("tiny-phi3", arch="phi3", seed=7)


# The test prompts are at most 48 tokens and decode 12 more: with an original context of 56
# the longest ones decode past it (HF switches to the long factors there, as we do).
PHI3_ORIGINAL_CONTEXT = 56


@pytest.fixture(scope="session")
def tiny_phi3_longrope_dir(make_tiny_model) -> Path:
    scaling = longrope_scaling(16, PHI3_ORIGINAL_CONTEXT)
    return make_tiny_model(
        "tiny-phi3-longrope",
        arch="phi3",
        rope_scaling=scaling,
        original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
        seed=8,
    )


@pytest.fixture(scope="session")
def tiny_phi4_mini_dir(make_tiny_model) -> Path:
    """Phi-4-mini's shape: LongRoPE over half of each head (partial_rotary_factor), tied
    embeddings."""
    scaling = longrope_scaling(8, PHI3_ORIGINAL_CONTEXT, seed=1)
    return make_tiny_model(
        "tiny-phi4-mini",
        arch="phi3",
        rope_scaling=scaling,
        original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
        partial_rotary_factor=0.5,
        tie_word_embeddings=True,
        seed=9,
    )


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The default GGUF model converted into a session-private cache (not ~/.cache)."""
    from engine.config import DEFAULT_MODEL
    from engine.models.loader import resolve_model

    return resolve_model(DEFAULT_MODEL, cache_dir=tmp_path_factory.mktemp("tessera-cache"))


def build_embedding_model(
    out_dir: Path,
    arch: str = "qwen3",
    pooling_mode: str | None = None,
    normalize: bool = True,
    config_extra: dict | None = None,
    seed: int = 11,
    **overrides,
) -> Path:
    """A tiny embedding model: build_tiny_model's weights saved by HF's AutoModel (a base-model
    class, `Qwen3Model` / `LlamaModel`: no LM head, tensor names without `model.`).
    pooling_mode ("lasttoken", "mean_tokens", "cls_token"): a sentence-transformers folder
    too (modules.json, 1_Pooling/config.json, a Normalize module if normalize);
    config_extra: more config.json keys (is_matryoshka, matryoshka_dimensions)."""
    import json

    from transformers import AutoModel

    build_tiny_model(out_dir, arch, seed=seed, **overrides)
    base = AutoModel.from_pretrained(str(out_dir), dtype="float32")
    (out_dir / "model.safetensors").unlink()  # the causal LM's, with its LM head
    base.save_pretrained(str(out_dir))
    if config_extra:
        cfg = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps({**cfg, **config_extra}))
    if pooling_mode is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]  # fmt: skip
        if normalize:
            modules.append(
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
            )  # fmt: skip
        (out_dir / "modules.json").write_text(json.dumps(modules))
        (out_dir / "1_Pooling").mkdir()
        flags = {
            f"pooling_mode_{m}": m == pooling_mode
            for m in ("lasttoken", "mean_tokens", "cls_token", "max_tokens")
        }
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": base.config.hidden_size, **flags}))  # fmt: skip
    return out_dir


@pytest.fixture(scope="session")
def make_embedding_model(tmp_path_factory) -> Callable[..., Path]:
    """make_embedding_model("name", **build_embedding_model's options) -> Path, built once."""
    made: dict[str, Path] = {}

    def make(name: str, **options) -> Path:
        if name not in made:
            made[name] = build_embedding_model(tmp_path_factory.mktemp(name), **options)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_embedding_dir(tmp_path_factory) -> Path:
    """Qwen3Model (no LM head: --runner auto pools, last token + normalize), Matryoshka-capable
    at 16 and 32 of its 64 dimensions."""
    extra = {"matryoshka_dimensions": [16, 32, 64]}
    return build_embedding_model(
        tmp_path_factory.mktemp("tiny-embedding"), head_dim=32, config_extra=extra
    )
