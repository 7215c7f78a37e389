"""Does a verify row equal the decode step for the same token and cache, bit for bit, on this device?

    python scripts/check_invariance.py --model DIR --dtype bfloat16 --dense-impl kernel slice

Lossless speculative greedy decoding needs the target's logits for a token to be the same
whether the token is scored alone (a plain decode step, one row per sequence) or in a verify
among the draft's tokens (T rows per sequence). Any op whose rounding depends on how many rows
share the call breaks that, and then speculative output can part from plain output at a near
tie. This script prefills `--batch` held-out (or random) prompts, then scores the next
`--tokens` tokens two ways on the same cache:

* decode: T single-token forwards in sequence, each writing its latent into the cache;
* verify: one forward over the T tokens (causal within them, a chain draft's tree mask).

It compares the two, layer by layer (the residual stream after every layer, captured), and
the logits, and prints per dense / expert path the fraction of (row, token) pairs that differ,
the first layer where any differs, the largest difference and how many argmaxes differ. Then
each stacked dense weight alone through `kernels.stacked_matmul`: a row's bits alone and among
B x T rows. On the CPU in float32 with the interpret paths everything must match exactly.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import share_model

from jaxspec import decode
from jaxspec.dtypes import COMPUTE_DTYPES
from jaxspec.engine import Engine
from jaxspec.kernels import stacked_matmul
from jaxspec.model import STACK, init_cache


def compare(engine: Engine, prompts_BP: np.ndarray, next_BT: np.ndarray) -> dict:
    cfg, model, params = engine.cfg, engine.model, engine.params
    B, P = prompts_BP.shape
    T = next_BT.shape[1]
    layers = tuple(range(cfg.num_layers))
    dtype = params["embed"]["embedding"].dtype

    @jax.jit
    def run(params, tokens, start, cache):
        positions = start + jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, cache, aux = decode.forward(model, params, tokens, positions, cache, layers)
        return logits, cache, aux

    cache = init_cache(cfg, B, P + T + 1, dtype)
    _, cache, _ = run(params, jnp.asarray(prompts_BP), jnp.int32(0), cache)
    # verify: the T tokens in one call
    v_logits, _, v_aux = run(params, jnp.asarray(next_BT), jnp.int32(P), cache)
    again, _, _ = run(params, jnp.asarray(next_BT), jnp.int32(P), cache)
    repeatable = bool(jnp.all(again == v_logits))
    # decode: one token at a time
    d_logits, d_aux = [], []
    c = cache
    for t in range(T):
        lg, c, ax = run(params, jnp.asarray(next_BT[:, t : t + 1]), jnp.int32(P + t), c)
        d_logits.append(lg)
        d_aux.append(ax)
    d_logits = np.concatenate([np.asarray(x, np.float32) for x in d_logits], axis=1)
    d_aux = np.concatenate([np.asarray(x.astype(jnp.float32)) for x in d_aux], axis=1)
    v_logits, v_aux = np.asarray(v_logits, np.float32), np.asarray(v_aux.astype(jnp.float32))
    D = cfg.hidden_size
    per_layer = []
    for i in layers:
        a, b = d_aux[..., i * D : (i + 1) * D], v_aux[..., i * D : (i + 1) * D]
        per_layer.append(float(np.mean(np.any(a != b, axis=-1))))
    differs = [i for i, f in enumerate(per_layer) if f > 0]
    return {
        "rows": B * T,
        "repeatable": repeatable,
        "decode_logits": d_logits,
        "verify_logits": v_logits,
        "layer_rows_differing": per_layer,
        "first_layer_differing": differs[0] if differs else None,
        "logit_rows_differing": float(np.mean(np.any(d_logits != v_logits, axis=-1))),
        "max_logit_diff": float(np.abs(d_logits - v_logits).max()),
        "argmax_differing": int(np.sum(d_logits.argmax(-1) != v_logits.argmax(-1))),
    }


def stacked_weights(engine: Engine) -> dict:
    """Every [L, K, N]-viewable stacked dense kernel of the engine's target, by path."""
    out = {}

    def walk(tree, path):
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, path + (k,))
        elif path and path[-1] == "kernel" and hasattr(tree, "ndim") and tree.ndim >= 3:
            out["/".join(path)] = tree

    walk(engine.params.get(STACK, {}), (STACK,))
    return out


def kernel_rows(engine: Engine, rows: int, impl: str, seed: int) -> list[dict]:
    """Each stacked weight through stacked_matmul: rows 0 and rows-1 alone vs among `rows`."""
    rng = np.random.default_rng(seed)
    res = []
    for path, w in stacked_weights(engine).items():
        nk = 2 if "o_proj" in path else 1  # o_proj [L, heads, head_dim, D] contracts heads and head_dim
        w3 = w.reshape(w.shape[0], int(np.prod(w.shape[1 : 1 + nk])), -1)
        K, N = w3.shape[1:]
        if not stacked_matmul.shapes_ok(K, N):
            continue
        x = jnp.asarray(rng.normal(size=(rows, K)), w3.dtype)
        f = jax.jit(lambda x, w: stacked_matmul.stacked_matmul(x, w, 1 % w.shape[0], interpret=impl == "interpret"))
        many = np.asarray(f(x, w3).astype(jnp.float32))
        bad = [
            r
            for r in sorted({0, 1, 15, 16, rows // 2, rows - 1} & set(range(rows)))
            if not np.array_equal(np.asarray(f(x[r : r + 1], w3).astype(jnp.float32))[0], many[r])
        ]
        ref = np.asarray(x, np.float64) @ np.asarray(w3[1 % w3.shape[0]], np.float64)
        err = float(np.abs(many - ref).max() / np.abs(ref).max())
        res.append({"weight": path, "K": K, "N": N, "rows": rows, "rows_differing_alone": bad, "rel_err": err})
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="converted checkpoint, or 'demo' (the built-in pair)")
    p.add_argument("--tokens-file", help=".npy of held-out token ids (default: random ids)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--tokens", type=int, default=4, help="tokens scored per sequence (a chain verify's T)")
    p.add_argument("--dtype", choices=COMPUTE_DTYPES)
    p.add_argument("--expert-impl", nargs="+", default=[None], choices=["kernel", "gather", "interpret"])
    p.add_argument("--dense-impl", nargs="+", default=[None], choices=["kernel", "slice", "interpret"])
    p.add_argument("--attention-impl", default=None, choices=["xla", "kernel", "interpret"])
    p.add_argument("--seed", type=int, default=0)
    share_model.add_kernel_config_flag(p)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.kernel_config:
        print(f"kernel configurations set: {share_model.apply_kernel_configs(args.kernel_config)}", flush=True)
    if args.model == "demo":
        from jaxspec import demo

        args.model = demo.ensure_converted(progress=False)
    rng = np.random.default_rng(args.seed)
    L = args.prompt_len + args.tokens
    rows, win = [], None
    for expert in args.expert_impl:
        for dense in args.dense_impl:
            engine = Engine.load(
                args.model, dtype=args.dtype, expert_impl=expert, dense_impl=dense, attention_impl=args.attention_impl
            )
            if win is None:  # the same windows for every path
                if args.tokens_file:
                    ids = np.load(args.tokens_file)
                    starts = rng.integers(0, len(ids) - L, size=args.batch)
                    win = np.stack([ids[s : s + L] for s in starts]).astype(np.int32)
                else:
                    win = rng.integers(0, engine.cfg.vocab_size, size=(args.batch, L)).astype(np.int32)
            r = compare(engine, win[:, : args.prompt_len], win[:, args.prompt_len :])
            if rows:  # against the first path: which of decode and verify moved
                r["decode_vs_first"] = float(np.abs(r["decode_logits"] - rows[0]["decode_logits"]).max())
                r["verify_vs_first"] = float(np.abs(r["verify_logits"] - rows[0]["verify_logits"]).max())
            r.update(expert_impl=engine.expert_layout, dense_impl=engine.dense_impl)
            if engine.dense_impl in ("kernel", "interpret"):
                r["kernel_rows"] = kernel_rows(engine, args.batch * args.tokens, engine.dense_impl, args.seed)
            rows.append(r)
    print(f"{'experts':>7} {'dense':>9} {'rows':>5} {'1st layer':>9} {'logit rows':>10} {'max diff':>9} {'argmax':>6}")
    for r in rows:
        first = "-" if r["first_layer_differing"] is None else str(r["first_layer_differing"])
        print(
            f"{r['expert_impl']:>7} {r['dense_impl']:>9} {r['rows']:>5} {first:>9} "
            f"{r['logit_rows_differing']:>10.3f} {r['max_logit_diff']:>9.2e} {r['argmax_differing']:>6}"
        )
        print("   rows differing after each layer: " + " ".join(f"{f:.2f}" for f in r["layer_rows_differing"]))
        print(f"   verify repeated: {'same bits' if r['repeatable'] else 'DIFFERENT BITS'}")
        if "decode_vs_first" in r:
            print(
                f"   max logit diff vs the first path ({rows[0]['dense_impl']}): decode {r['decode_vs_first']:.2e}, "
                f"verify {r['verify_vs_first']:.2e}"
            )
        for k in r.get("kernel_rows", []):
            state = "same bits" if not k["rows_differing_alone"] else f"rows {k['rows_differing_alone']} DIFFER"
            print(
                f"   stacked_matmul {k['weight']} [{k['K']}x{k['N']}], {k['rows']} rows: {state}; "
                f"error vs float64 {k['rel_err']:.1e}"
            )
    for r in rows:
        del r["decode_logits"], r["verify_logits"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    clean = all(r["logit_rows_differing"] == 0 for r in rows)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
