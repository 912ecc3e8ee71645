"""Issue 39: the greedy text of a GGUF file, llama.cpp's llama-completion against this engine on the
same file: the default model's Q8_0 and Q4_0 (llama-quantize from its f32 GGUF, made by
`bench_llamacpp.py --model default --dtypes float32,q4_0 --prepare-only`; Q8_0 by hand), the
8 built-in bench prompts x 32 tokens, repetition penalty off on both sides. llama-completion is
built beside llama-bench (`make llama-completion` in W/build-native).

    python benchmarks/probes/gguf_vs_llamacpp.py      (W = /work/llamacpp-work)
"""
import subprocess
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.cli.bench import BUILTIN_PROMPTS
BIN = "/work/llamacpp-work/build-native/bin/llama-completion"
prompts = BUILTIN_PROMPTS[:8]
for qtype in ("q8_0", "q4_0"):
    path = f"/work/llamacpp-work/gguf/default-{qtype}.gguf"
    ours = LLM(model=path).generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                            repetition_penalty=1.0), use_tqdm=False)
    same = 0
    for p, o in zip(prompts, ours):
        r = subprocess.run([BIN, "-m", path, "-p", p, "-n", "32", "--temp", "0", "--repeat-penalty", "1.0", "-no-cnv",
                            "--no-display-prompt", "-t", "2", "--ignore-eos", "--no-warmup", "-s", "1"],
                           capture_output=True, text=True, timeout=120)
        theirs = r.stdout
        ok = theirs.startswith(o.text) or o.text.startswith(theirs.rstrip()) and len(theirs.strip()) > 0
        same += ok
        print(qtype, "SAME" if ok else "DIFF", repr(p[:30]), "| ours:", repr(o.text[:60]), "| llama.cpp:", repr(theirs[:60]))
    print(qtype, f"{same}/8 prompts give the same greedy text")
