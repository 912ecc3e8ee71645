"""Train the engine's embedded default model: a tiny Qwen3.5 hybrid LM with an MTP head.

    python examples/train_default_model.py                       # train, evaluate, write the assets
    python examples/train_default_model.py --steps 20 --out /tmp/x   # a quick smoke run

Corpus: the Python standard library's own source (``sysconfig.get_paths()["stdlib"]``, ``*.py``;
test suites, site-packages and the data-table packages encodings/ and pydoc_data/ excluded),
which exists on every machine. A fixed ~4% of the files (chosen by a hash of the relative path)
is held out for evaluation. The exact corpus therefore depends on the Python version; the default
model was trained on CPython 3.11.7 (582 train files, 2.77M tokens).

Cost: 600 steps of 16 x 256 tokens (0.9 epoch), bf16 autocast on CPU. On 2 cores shared with other
jobs that took 30 min (3.0 s/step); with the cores to itself a step is about 1.3-1.5 s.

Model: transformers' ``Qwen3_5ForCausalLM`` (``qwen3_5_text``, dense, GDN layers with full
attention every 4th, tied embeddings; torch fallbacks, no fla), plus an MTP head assembled from
transformers pieces under the checkpoint names of real Qwen3.5 checkpoints (``mtp.*``):

    x_i   = mtp.fc(cat[pre_fc_norm_embedding(embed(tok_{i+1})), pre_fc_norm_hidden(h_i)])
    g_i   = mtp.norm(mtp.layers.0(x, RoPE position i, causal over MTP positions))
    logits(tok_{i+2}) = lm_head(g_i)                     # the shared (tied) lm_head

h_i is the main model's final-normed hidden state (what lm_head reads). A second, chained MTP step
is also trained (weight --mtp2-weight): the MTP layer's own output g_i stands in for h, the input
token is tok_{i+2}, the RoPE position is i+1, it attends to the first-step MTP entries at positions
<= i and to itself, and it predicts tok_{i+3}: this is what drafting a 2nd token (k=2) looks like.

Loss = CE(main, tok_{i+1}) + w1 * CE(MTP, tok_{i+2}) + w2 * CE(MTP chained, tok_{i+3}).

Outputs (``--out``, default ``hybrid_engine/assets/default_model``): config.json,
model.safetensors (``model.*`` as ``save_pretrained`` names them, plus ``mtp.*``), tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json. Seeded: the same Python, torch and thread count
give the same weights up to floating-point reordering. examples/distill_mtp_head.py then self-distils the MTP head.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

# On a shared machine, OpenMP threads that spin while waiting make a 2-thread run 5-10x slower
# when other processes compete for the cores; passive waiting avoids that. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from qwen35_bpe import QWEN35_EOS_TOKEN, train_qwen35_bpe  # noqa: E402  (this folder)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "hybrid_engine" / "assets" / "default_model"

EVAL_PROMPTS = ("def ", "import os\n", "class ", "    def __init__(self", "for i in range(",
                "if __name__ == '__main__':\n", "    return ", "try:\n    ")


def log(*a):
    print(*a, flush=True)


# ---- corpus --------------------------------------------------------------------------------------

# Not code to learn from: installed packages, test suites, and data tables written as Python
# (encodings/ is mostly generated charmap tables, pydoc_data/ one 750 KB string literal).
SKIP_DIRS = ("site-packages", "dist-packages", "idle_test", "encodings", "pydoc_data")


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) stdlib *.py files; SKIP_DIRS and test*/ excluded, sorted, fixed split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).parts
        if any(p in SKIP_DIRS or p.startswith("test") for p in parts[:-1]):
            continue
        rel = "/".join(parts)
        (held if int(hashlib.md5(rel.encode()).hexdigest(), 16) % 25 == 0 else train).append(f)
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


# ---- tokenizer -----------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with the Qwen3.5 pre-tokenizer; returns a transformers fast tokenizer."""
    return train_qwen35_bpe(texts, vocab_size)


def encode_corpus(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """All files, each followed by <|endoftext|>, as one int32 token stream."""
    ids = []
    for enc in tok._tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


# ---- model ---------------------------------------------------------------------------------------

def make_config(args, vocab_size: int, eos_id: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, full_attention_interval=4,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        linear_num_key_heads=args.gdn_k_heads, linear_num_value_heads=args.gdn_v_heads,
        linear_key_head_dim=args.gdn_head_dim, linear_value_head_dim=args.gdn_head_dim,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True, eos_token_id=eos_id, pad_token_id=None, bos_token_id=None,
        initializer_range=0.02,
    )


class MTP(nn.Module):
    """The training-side MTP head, named exactly like the checkpoint's mtp.* tensors."""

    def __init__(self, config):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        super().__init__()
        h = config.hidden_size
        full = config.layer_types.index("full_attention")
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, full)])  # a full-attention layer
        self.norm = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        assert self.layers[0].block_type == "full_attention"

    def inputs(self, token_embeds, hidden):
        e = self.pre_fc_norm_embedding(token_embeds)
        h = self.pre_fc_norm_hidden(hidden)
        return self.fc(torch.cat([e, h], dim=-1))  # [embedding | hidden]

    def layer(self, x, rope, mask=None):
        return self.norm(self.layers[0](x, position_embeddings=rope, attention_mask=mask))


def rope_for(model, x, positions):
    """cos/sin for text positions [B, T] (the mRoPE sections collapse for text)."""
    return model.model.rotary_emb(x, positions[None].expand(3, -1, -1))


def chained_mask(T: int, device) -> torch.Tensor:
    """[2T, 2T] bool mask (True = attend) for [step-1 entries 0..T-1 | chained entries 0..T-1]:
    step-1 entry i sees step-1 entries <= i; chained entry i (RoPE position i+1) sees step-1
    entries <= i and itself."""
    idx = torch.arange(T, device=device)
    causal = idx[None, :] <= idx[:, None]
    m = torch.zeros(2 * T, 2 * T, dtype=torch.bool, device=device)
    m[:T, :T] = causal
    m[T:, :T] = causal
    m[T:, T:] = torch.eye(T, dtype=torch.bool, device=device)
    return m


def forward_losses(model, mtp, batch, w2: float):
    """batch [B, T+3] token ids -> (main CE, MTP CE t+2, chained MTP CE t+3, aux dict)."""
    B, L = batch.shape
    T = L - 3
    inp = batch[:, :T]
    out = model.model(input_ids=inp, use_cache=False)
    h = out.last_hidden_state                                   # [B, T, H] final-normed
    lm_w = model.lm_head.weight
    main = F.cross_entropy(F.linear(h, lm_w).flatten(0, 1).float(), batch[:, 1:T + 1].flatten().long())
    emb = model.model.embed_tokens
    pos = torch.arange(T, device=batch.device)[None].expand(B, -1)
    x1 = mtp.inputs(emb(batch[:, 1:T + 1]), h)                  # step 1 at position i: tok_{i+1}, h_i
    if w2 <= 0:
        g1 = mtp.layer(x1, rope_for(model, x1, pos))
        m1 = F.cross_entropy(F.linear(g1, lm_w).flatten(0, 1).float(), batch[:, 2:T + 2].flatten().long())
        return main, m1, torch.zeros(()), {}
    # Step 1 alone gives g1; the chained step then runs over [step-1 entries | chained entries]
    # with chained_mask, so a chained entry sees the step-1 keys <= i and itself.
    g1 = mtp.layer(x1, rope_for(model, x1, pos))
    m1 = F.cross_entropy(F.linear(g1, lm_w).flatten(0, 1).float(), batch[:, 2:T + 2].flatten().long())
    x2 = mtp.inputs(emb(batch[:, 2:T + 2]), g1)                 # chained: tok_{i+2}, g_i, position i+1
    xx = torch.cat([x1, x2], dim=1)
    pp = torch.cat([pos, pos + 1], dim=1)
    mask = chained_mask(T, batch.device)[None, None].expand(B, 1, -1, -1)
    gg = mtp.layer(xx, rope_for(model, xx, pp), mask)
    g2 = gg[:, T:]
    m2 = F.cross_entropy(F.linear(g2, lm_w).flatten(0, 1).float(), batch[:, 3:T + 3].flatten().long())
    return main, m1, m2, {}


# ---- evaluation ----------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, mtp, stream: torch.Tensor, seq: int, max_windows: int = 64):
    """Held-out teacher-forced metrics over non-overlapping windows of the held-out stream."""
    model.eval(); mtp.eval()
    n = min(max_windows, (len(stream) - 3) // seq)
    tot = {"main": 0.0, "mtp": 0.0, "mtp2": 0.0, "acc_main": 0.0, "acc_mtp": 0.0, "acc_mtp2": 0.0,
           "agree_mtp": 0.0}
    count = 0
    for w in range(0, n, 8):
        rows = [stream[i * seq:i * seq + seq + 3] for i in range(w, min(n, w + 8))]
        batch = torch.stack(rows).long()
        B, T = batch.shape[0], seq
        h = model.model(input_ids=batch[:, :T], use_cache=False).last_hidden_state
        lm_w = model.lm_head.weight
        lg = F.linear(h, lm_w)
        emb = model.model.embed_tokens
        pos = torch.arange(T)[None].expand(B, -1)
        x1 = mtp.inputs(emb(batch[:, 1:T + 1]), h)
        g1 = mtp.layer(x1, rope_for(model, x1, pos))
        l1 = F.linear(g1, lm_w)
        x2 = mtp.inputs(emb(batch[:, 2:T + 2]), g1)
        xx, pp = torch.cat([x1, x2], 1), torch.cat([pos, pos + 1], 1)
        mask = chained_mask(T, batch.device)[None, None].expand(B, 1, -1, -1)
        g2 = mtp.layer(xx, rope_for(model, xx, pp), mask)[:, T:]
        l2 = F.linear(g2, lm_w)
        t1, t2, t3 = batch[:, 1:T + 1], batch[:, 2:T + 2], batch[:, 3:T + 3]
        k = B * T
        tot["main"] += F.cross_entropy(lg.flatten(0, 1), t1.flatten(), reduction="sum").item()
        tot["mtp"] += F.cross_entropy(l1.flatten(0, 1), t2.flatten(), reduction="sum").item()
        tot["mtp2"] += F.cross_entropy(l2.flatten(0, 1), t3.flatten(), reduction="sum").item()
        tot["acc_main"] += (lg.argmax(-1) == t1).sum().item()
        tot["acc_mtp"] += (l1.argmax(-1) == t2).sum().item()
        tot["acc_mtp2"] += (l2.argmax(-1) == t3).sum().item()
        # agreement of the MTP draft with the main model's own next-next prediction (from h_{i+1})
        tot["agree_mtp"] += (l1[:, :-1].argmax(-1) == lg[:, 1:].argmax(-1)).sum().item() * T / (T - 1)
        count += k
    model.train(); mtp.train()
    return {k: v / count for k, v in tot.items()}


@torch.no_grad()
def greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with transformers' generate (the main model only)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0].tolist()


@torch.no_grad()
def accept_lengths(model, mtp, prompts: list[list[int]], n_new: int, k: int = 2):
    """Greedy speculative decoding with MTP drafts, simulated exactly from the greedy sequence.

    With greedy verification the output is the main model's greedy continuation G, so whether the
    drafts made after emitting G[j+1] are accepted depends only on j: draft 1 = MTP(G[j+1], h_j)
    must equal G[j+2]; draft 2 = MTP(G[j+2], g_j) (chained, position j+1, attending to the step-1
    MTP entries <= j) must equal G[j+3]. A verify step at j accepts m drafts and moves to j+1+m.
    Returns (mean tokens per verify step = 1 + mean accepted, rate draft 1, rate draft 2 | draft 1)."""
    model.eval(); mtp.eval()
    lengths, d1_ok, d1_n, d2_ok, d2_n = [], 0, 0, 0, 0
    for ids in prompts:
        g = greedy_tokens(model, ids, n_new + k + 1)
        G = torch.tensor([g])
        L = G.shape[1]
        h = model.model(input_ids=G, use_cache=False).last_hidden_state  # [1, L, H]
        lm_w = model.lm_head.weight
        emb = model.model.embed_tokens
        T = L - 1  # MTP positions j = 0..L-2 (input G[j+1], h_j)
        pos = torch.arange(T)[None]
        x1 = mtp.inputs(emb(G[:, 1:]), h[:, :T])
        g1 = mtp.layer(x1, rope_for(model, x1, pos))
        d1 = F.linear(g1, lm_w).argmax(-1)[0]                          # draft for G[j+2]
        # chained: entry j uses input G[j+2] (= draft 1 when accepted) and g1_j, position j+1
        T2 = T - 1
        x2 = mtp.inputs(emb(G[:, 2:]), g1[:, :T2])
        xx = torch.cat([x1[:, :T2], x2], 1)
        pp = torch.cat([pos[:, :T2], pos[:, :T2] + 1], 1)
        g2 = mtp.layer(xx, rope_for(model, xx, pp), chained_mask(T2, G.device)[None, None])[:, T2:]
        d2 = F.linear(g2, lm_w).argmax(-1)[0]                          # draft for G[j+3]
        j = len(ids) - 1                      # first emitted token is G[len(ids)] from h_{len-1}
        end = len(ids) - 1 + n_new
        while j < end:
            m = 0
            ok1 = d1[j].item() == g[j + 2]
            d1_n += 1
            if ok1:
                d1_ok += 1
                m = 1
                if k >= 2:
                    d2_n += 1
                    if d2[j].item() == g[j + 3]:
                        d2_ok += 1
                        m = 2
            lengths.append(1 + m)
            j += 1 + m
    model.train(); mtp.train()
    return sum(lengths) / len(lengths), d1_ok / max(d1_n, 1), d2_ok / max(d2_n, 1)


# ---- saving --------------------------------------------------------------------------------------

def save(model, mtp, tok, out: Path, eos_id: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.is_file():
            p.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = {}
        with safe_open(str(Path(tmp) / "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
        for name, t in mtp.state_dict().items():
            tensors["mtp." + name] = t.detach().float().contiguous()
        save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((Path(tmp) / "config.json").read_text())
        gen = json.loads((Path(tmp) / "generation_config.json").read_text())
    cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, eos_token_id=eos_id)
    cfg.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen.pop("transformers_version", None)
    gen["eos_token_id"] = eos_id
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(str(out))
    for p in out.iterdir():
        p.chmod(0o644)


# ---- main ----------------------------------------------------------------------------------------

def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=3072)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--gdn-k-heads", type=int, default=2)
    ap.add_argument("--gdn-v-heads", type=int, default=4)
    ap.add_argument("--gdn-head-dim", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--mtp2-weight", type=float, default=0.2)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for the matmuls (fp32 weights, optimizer and loss)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--accept-prompts", type=int, default=24)
    ap.add_argument("--accept-new", type=int, default=64)
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import transformers
    from transformers import Qwen3_5ForCausalLM

    transformers.logging.set_verbosity_error()
    log(f"python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}"
        f"  threads {args.threads}")
    log("args:", json.dumps({k: str(v) for k, v in vars(args).items()}))

    train_files, held_files = stdlib_files()
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    log(f"corpus: {len(train_texts)} train files ({sum(map(len, train_texts)) / 1e6:.1f} MB), "
        f"{len(held_texts)} held-out files ({sum(map(len, held_texts)) / 1e6:.2f} MB)")
    t0 = time.time()
    tok = train_tokenizer(train_texts, args.vocab)
    eos_id = tok.convert_tokens_to_ids(QWEN35_EOS_TOKEN)
    train_ids = encode_corpus(tok, train_texts, eos_id)
    held_ids = encode_corpus(tok, held_texts, eos_id)
    log(f"tokenizer: vocab {len(tok)}, eos {eos_id}; train {len(train_ids) / 1e6:.2f}M tokens "
        f"({sum(map(len, train_texts)) / len(train_ids):.2f} chars/token), held-out "
        f"{len(held_ids) / 1e3:.0f}k tokens  [{time.time() - t0:.1f}s]")

    config = make_config(args, len(tok), eos_id)
    model = Qwen3_5ForCausalLM(config).float()
    mtp = MTP(config).float()
    mtp.apply(model._init_weights)
    model.train(); mtp.train()
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log(f"model: {n_main / 1e6:.2f}M params (+ MTP {n_mtp / 1e6:.2f}M), layer_types {config.layer_types}")

    params = [p for p in list(model.parameters()) + list(mtp.parameters())]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed + 1)
    L = args.seq + 3
    hi = len(train_ids) - L
    tokens_per_step = args.batch * args.seq
    n_tok = args.steps * tokens_per_step
    log(f"training: {args.steps} steps x {tokens_per_step} tokens = {n_tok / 1e6:.2f}M "
        f"tokens ({n_tok / len(train_ids):.2f} epochs)")

    t_train = time.time()
    ema = None
    for step in range(args.steps):
        starts = torch.randint(0, hi, (args.batch,), generator=gen)
        batch = torch.stack([train_ids[s:s + L] for s in starts.tolist()]).long()
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            main_l, m1, m2, _ = forward_losses(model, mtp, batch, args.mtp2_weight)
        loss = main_l + args.mtp_weight * m1 + args.mtp2_weight * m2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        cur = torch.tensor([main_l.item(), m1.item(), m2.item()])
        ema = cur if ema is None else 0.9 * ema + 0.1 * cur
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_train
            log(f"step {step:5d}  loss {main_l.item():.3f}  mtp {m1.item():.3f}  mtp2 {m2.item():.3f}  "
                f"(ema {ema[0]:.3f}/{ema[1]:.3f}/{ema[2]:.3f})  lr {lr:.2e}  gnorm {gnorm:.2f}  "
                f"{el:.0f}s  {(step + 1) * tokens_per_step / el:.0f} tok/s")
        if args.eval_every and step and step % args.eval_every == 0:
            ev = evaluate(model, mtp, held_ids, args.seq, max_windows=32)
            log("eval @%d: " % step + "  ".join(f"{k} {v:.3f}" for k, v in ev.items()))
    train_s = time.time() - t_train
    log(f"training done in {train_s:.0f}s ({train_s / args.steps:.2f} s/step)")

    t0 = time.time()
    ev = evaluate(model, mtp, held_ids, args.seq, max_windows=64)
    log("held-out (teacher forced, %d tokens): " % (min(64, (len(held_ids) - 3) // args.seq) * args.seq)
        + "  ".join(f"{k} {v:.4f}" for k, v in ev.items()))
    # Held-out prompts for the accept-length estimate: 16-token prefixes at line starts.
    pg = torch.Generator().manual_seed(args.seed + 2)
    prompts = []
    for text in held_texts:
        lines = [i for i, c in enumerate(text) if c == "\n"]
        if len(lines) < 10:
            continue
        pick = lines[int(torch.randint(0, len(lines) - 5, (1,), generator=pg))] + 1
        ids = tok.encode(text[pick:pick + 400], add_special_tokens=False)[:32]
        if len(ids) == 32:
            prompts.append(ids)
    prompts = prompts[:args.accept_prompts]
    prompts += [tok.encode(p, add_special_tokens=False) for p in EVAL_PROMPTS]
    acc_len, r1, r2 = accept_lengths(model, mtp, prompts, args.accept_new, k=2)
    log(f"greedy MTP drafting, k=2, {len(prompts)} held-out prompts x {args.accept_new} tokens: "
        f"mean accept length {acc_len:.3f} tokens/verify step (draft-1 accepted {r1:.3f}, "
        f"draft-2 accepted given draft-1 {r2:.3f})  [{time.time() - t0:.0f}s]")
    for p in EVAL_PROMPTS[:3]:
        ids = tok.encode(p, add_special_tokens=False)
        g = greedy_tokens(model, ids, 48)
        log(f"--- greedy from {p!r}:\n{tok.decode(g)}")

    save(model, mtp, tok, args.out, eos_id)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    names = ", ".join(sorted(f.name for f in args.out.iterdir()))
    log(f"saved to {args.out} ({size / 1e6:.2f} MB): {names}")
    log(f"total wall time {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
