"""Self-distil the default model's MTP head on the main model's own greedy continuations.

    python examples/distill_mtp_head.py                      # distil, evaluate, overwrite the asset
    python examples/distill_mtp_head.py --out /tmp/distilled  # write a complete model folder elsewhere

Why: examples/train_default_model.py trained the MTP head to predict the corpus (token i+2), but
greedy speculative decoding accepts a draft only when it equals the main model's own greedy token.
Training the head on the main model's outputs (as draft heads usually are) makes them agree more.

Data: random 16-64-token windows of the training split of the stdlib corpus (never the held-out
files, the bench prompts nor EVAL_PROMPTS), each continued greedily by this engine to --seq-len
tokens in all. The frozen main model's final hidden states h_i and greedy argmaxes a_i (its
prediction for token i+1) are computed once, in float32 as the engine runs, and cached.

Training: only the mtp.* parameters (AdamW, warm-up then cosine). Hard targets: step-1 MTP at i
(input embed(tok_{i+1}), h_i) learns a_{i+1}; the chained step (input tok_{i+2}, g_i, position
i+1, as in train_default_model.forward_losses) learns a_{i+2}. On the generated part a_{i+1} is
the sequence's own token i+2; on the prompt part it is what the main model would have said.

Evaluation, before and after, on held-out corpus prompts: train_default_model.accept_lengths
(k=2, exact greedy simulation) and the engine's own speculative counters at --eval-k. The new
model.safetensors keeps every model.* tensor byte for byte (copied from the source file) and the
metadata; only mtp.* changes. It is written only if the k=2 mean accept length improved.

Cost on 2 shared CPU cores with the defaults: about 10 minutes (the engine's 312k greedy tokens 4 min,
the main model's cached outputs 1.5 min, 300 steps 2 min, each of the two evaluations 1.3 min).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

# Passive OpenMP waiting: spinning threads make a 2-thread run much slower on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_default_model", REPO / "examples" / "train_default_model.py")
tdm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tdm)
log = tdm.log


def sample_prompts(tok, texts: list[str], n: int, lengths: tuple[int, int], gen) -> list[list[int]]:
    """n token windows starting at random line starts of random files (weighted by size)."""
    weights = torch.tensor([float(len(t)) for t in texts])
    prompts = []
    while len(prompts) < n:
        text = texts[int(torch.multinomial(weights, 1, generator=gen))]
        starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        pick = starts[int(torch.randint(0, len(starts), (1,), generator=gen))]
        want = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        ids = tok.encode(text[pick:pick + 12 * want], add_special_tokens=False)[:want]
        if len(ids) == want:   # skip windows that run into the end of a file
            prompts.append(ids)
    return prompts


def load(folder: Path):
    """(main model, MTP head) from a model folder; the main model frozen, in eval mode."""
    from safetensors import safe_open
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.requires_grad_(False)
    mtp = tdm.MTP(model.config).float()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        mtp.load_state_dict({k[4:]: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")})
    return model, mtp


@torch.no_grad()
def greedy_data(folder: Path, prompts: list[list[int]], seq_len: int):
    """Each prompt continued greedily by the engine to seq_len tokens -> int64 [N, seq_len]."""
    from hybrid_engine import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="float32")
    params = [SamplingParams(temperature=0, max_tokens=seq_len - len(p), ignore_eos=True) for p in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return torch.tensor([p + o.token_ids for p, o in zip(prompts, outs)])


@torch.no_grad()
def main_outputs(model, seqs: torch.Tensor, chunk: int = 32):
    """The frozen main model's final hidden states [N, L, H] and greedy argmaxes [N, L]."""
    hs, am = [], []
    for i in range(0, len(seqs), chunk):
        h = model.model(input_ids=seqs[i:i + chunk], use_cache=False).last_hidden_state
        hs.append(h)
        am.append(model.lm_head(h).argmax(-1))
    return torch.cat(hs), torch.cat(am)


def distill_losses(model, mtp, toks, h, argmax):
    """CE of step-1 MTP against a_{i+1} and of the chained step against a_{i+2}."""
    B, L = toks.shape
    T = L - 2
    emb, lm_w = model.model.embed_tokens, model.lm_head.weight
    pos = torch.arange(T)[None].expand(B, -1)
    x1 = mtp.inputs(emb(toks[:, 1:T + 1]), h[:, :T])
    g1 = mtp.layer(x1, tdm.rope_for(model, x1, pos))
    x2 = mtp.inputs(emb(toks[:, 2:T + 2]), g1)
    xx, pp = torch.cat([x1, x2], 1), torch.cat([pos, pos + 1], 1)
    mask = tdm.chained_mask(T, toks.device)[None, None].expand(B, 1, -1, -1)
    g2 = mtp.layer(xx, tdm.rope_for(model, xx, pp), mask)[:, T:]

    def ce(g, target):
        return F.cross_entropy(F.linear(g, lm_w).flatten(0, 1).float(), target.flatten())

    return ce(g1, argmax[:, 1:T + 1]), ce(g2, argmax[:, 2:T + 2])


@torch.no_grad()
def engine_acceptance(folder: Path, prompts: list[list[int]], n_new: int, k: int) -> dict:
    """The engine's own speculative counters (greedy, k drafts) over the prompts."""
    from hybrid_engine import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True), use_tqdm=False)
    return llm.engine.spec_stats.as_dict()


def write_model(src: Path, out: Path, mtp) -> None:
    """src's folder with mtp.* replaced: model.* tensors copied from src's file, metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    new = {"mtp." + k: v.detach() for k, v in mtp.state_dict().items()}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert set(new) == {k for k in tensors if k.startswith("mtp.")}
    for k, v in new.items():
        tensors[k] = v.to(tensors[k].dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != src.resolve():
        for p in src.iterdir():
            if p.is_file() and p.name != "model.safetensors":
                shutil.copy2(p, out / p.name)
    tmp = out / "model.safetensors.tmp"     # a complete file or none, even if interrupted
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(out / "model.safetensors")


def check_main_identical(a: Path, b: Path) -> int:
    """Asserts every model.* tensor of b equals a's (names, dtypes, shapes, values); returns the count."""
    from safetensors import safe_open

    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        assert set(fa.keys()) == set(fb.keys()) and fa.metadata() == fb.metadata()
        names = [k for k in fa.keys() if k.startswith("model.")]
        for k in fa.keys():
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert k not in names or torch.equal(x, y), k
    return len(names)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=tdm.DEFAULT_OUT, help="model folder to read")
    ap.add_argument("--out", type=Path, default=None, help="folder to write (default: --model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2048, help="training prompts")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--seq-len", type=int, default=192, help="prompt + greedy continuation, tokens")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--mtp2-weight", type=float, default=0.5, help="weight of the chained step's loss")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for the MTP matmuls (fp32 weights, optimizer and loss)")
    ap.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts (32 tokens each)")
    ap.add_argument("--eval-new", type=int, default=64, help="tokens generated per held-out prompt")
    ap.add_argument("--eval-k", type=int, default=3, help="draft tokens for the engine's held-out counters")
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()   # the checkpoint's mtp.* are unexpected keys to HF
    transformers.logging.disable_progress_bar()
    src = args.model
    args.out = args.out or src
    tok = AutoTokenizer.from_pretrained(str(src))
    train_files, held_files = tdm.stdlib_files()
    train_texts, held_texts = tdm.read_texts(train_files), tdm.read_texts(held_files)
    gen = torch.Generator().manual_seed(args.seed)
    train_prompts = sample_prompts(tok, train_texts, args.prompts, tuple(args.prompt_len), gen)
    held_prompts = sample_prompts(tok, held_texts, args.eval_prompts, (32, 32), gen)

    t0 = time.time()
    seqs = greedy_data(src, train_prompts, args.seq_len)
    n_prompt = sum(map(len, train_prompts))
    log(f"data: {len(seqs)} training-split prompts ({n_prompt} tokens) + {seqs.numel() - n_prompt} "
        f"greedy tokens = {seqs.numel()} tokens  [{time.time() - t0:.0f}s]")
    model, mtp = load(src)
    t0 = time.time()
    hidden, argmax = main_outputs(model, seqs)
    # On the generated part the main model's argmax must be the next token (float32 both ways).
    gen_mask = torch.arange(args.seq_len - 1)[None] >= torch.tensor([len(p) - 1 for p in train_prompts])[:, None]
    agree = (argmax[:, :-1] == seqs[:, 1:])[gen_mask].float().mean().item()
    log(f"main model outputs cached [{time.time() - t0:.0f}s]; its argmax matches the engine's greedy "
        f"tokens at {agree:.5f} of generated positions")

    def evaluate(folder: Path, tag: str) -> float:
        t0 = time.time()
        acc_len, r1, r2 = tdm.accept_lengths(model, mtp, held_prompts, args.eval_new, k=2)
        st = engine_acceptance(folder, held_prompts, args.eval_new, args.eval_k)
        log(f"{tag}: accept_lengths k=2: mean accept length {acc_len:.3f} (draft 1 {r1:.3f}, draft 2 given "
            f"draft 1 {r2:.3f}); engine k={args.eval_k}: accept rate per draft position "
            + " ".join(f"{a:.3f}" for a in st["acceptance_rate_per_position"])
            + f", mean accept length {st['mean_accept_length']:.3f}  "
            f"[{len(held_prompts)} held-out prompts x {args.eval_new} tokens, {time.time() - t0:.0f}s]")
        return acc_len

    before = evaluate(src, "before")

    mtp.train()
    params = list(mtp.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    # lr_at reads warmup/steps/lr and the floor of the cosine as a fraction of lr.
    sched = argparse.Namespace(lr=args.lr, warmup=args.warmup, steps=args.steps, min_lr_frac=0.1)
    t0 = time.time()
    for step in range(args.steps):
        idx = torch.randint(0, len(seqs), (args.batch,), generator=gen)
        for g in opt.param_groups:
            g["lr"] = tdm.lr_at(step, sched)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            l1, l2 = distill_losses(model, mtp, seqs[idx], hidden[idx], argmax[idx])
        loss = l1 + args.mtp2_weight * l2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            log(f"step {step:4d}  ce draft-1 {l1.item():.3f}  ce draft-2 {l2.item():.3f}  {time.time() - t0:.0f}s")
    log(f"training: {args.steps} steps x {args.batch} sequences in {time.time() - t0:.0f}s")
    mtp.eval()

    with tempfile.TemporaryDirectory() as tmp:
        cand = Path(tmp)
        write_model(src, cand, mtp)
        n = check_main_identical(src / "model.safetensors", cand / "model.safetensors")
        log(f"candidate: all {n} model.* tensors identical to {src}")
        after = evaluate(cand, "after")
        if after <= before:
            log(f"held-out accept length did not improve ({before:.3f} -> {after:.3f}); nothing written")
            return 1
        write_model(src, args.out, mtp)
        check_main_identical(cand / "model.safetensors", args.out / "model.safetensors")
    log(f"written to {args.out}; total wall time {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
