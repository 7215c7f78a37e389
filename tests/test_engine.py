"""Plain generation through the engine, against transformers' own greedy generate."""

import dataclasses
import json
import os
import subprocess
import sys

import cpu_env
import hf_models
import jax
import numpy as np
import pytest
import torch

from checkpoints_convert.convert import convert
from jaxspec.engine import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    hf = hf_models.build(str(root / "hf"), seed=3, eos_token_id=200)  # eos outside vocab: never hit
    convert(str(root / "hf"), str(root / "ck"), dtype="float32", progress=False)
    return hf, Engine.load(str(root / "ck"), dtype="float32")


def hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def test_greedy_matches_transformers_batch_of_mixed_lengths(pair):
    hf, engine = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (4, 11, 7)]
    results = engine.generate(prompts, max_new_tokens=12)
    for p, r in zip(prompts, results):
        assert r.tokens == hf_greedy(hf, p, 12)
        assert r.stats["new_tokens"] == 12


def test_eos_stops_only_its_row(pair):
    hf, engine = pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (5, 9)]
    full = [hf_greedy(hf, p, 10) for p in prompts]
    stop = full[0][3]  # row 0 emits this at its 4th step
    eng = Engine(dataclasses.replace(engine.cfg, eos_token_id=stop), engine.params, None, "float32")
    results = eng.generate(prompts, max_new_tokens=10)
    for f, r in zip(full, results):
        expect = f[: f.index(stop) + 1] if stop in f else f
        assert r.tokens == expect
    assert len(results[0].tokens) <= 4  # row 0 really stopped early


def test_sampling_is_seeded_and_top_k_1_is_greedy(pair):
    _, engine = pair
    prompt = [[5, 6, 7, 8]]
    a = engine.generate(prompt, 8, temperature=1.0, seed=7)[0].tokens
    b = engine.generate(prompt, 8, temperature=1.0, seed=7)[0].tokens
    c = engine.generate(prompt, 8, temperature=1.0, seed=8)[0].tokens
    assert a == b and a != c
    assert engine.generate(prompt, 8, temperature=0.7, top_k=1)[0].tokens == engine.generate(prompt, 8)[0].tokens


MESH_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[2] + "/tests")
import jax
import hf_models
from checkpoints_convert.convert import convert
from jaxspec.engine import Engine
root = sys.argv[1]
hf_models.build(root + "/hf", seed=5, vocab_size=104, num_attention_heads=8, num_key_value_heads=8,
                n_routed_experts=16, num_experts_per_tok=4, n_group=2, topk_group=1)
convert(root + "/hf", root + "/ck", dtype="float32", progress=False)
one = Engine.load(root + "/ck", dtype="float32", num_devices=1)
eight = Engine.load(root + "/ck", dtype="float32", num_devices=8)
ids = list(range(3, 40))
a, b = one.target_logits(ids), eight.target_logits(ids)
prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4]]
ga = [r.tokens for r in one.generate(prompts, 10)]
gb = [r.tokens for r in eight.generate(prompts, 10)]
# Speculative decoding on the mesh: the draft replicated, the target sharded.
import jax.numpy as jnp
from jaxspec import spec
from jaxspec.draft import DraftConfig, init_params as draft_init
dcfg = DraftConfig.from_hf({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 104,
    "draft_vocab_size": 104, "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 10000.0,
    "num_hidden_layers": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}})
eight.draft = eight.attach_draft(draft_init(dcfg, jax.random.key(3)), jnp.zeros(104, jnp.int32), dcfg, (0, 1, 1))
gs = [r.tokens for r in eight.generate(prompts, 10, spec=spec.SpecConfig(3, 2, 6))]
eight.prefill_chunk = 2  # chunked prefill (a scan over the sharded cache), plain and speculative
gc = [r.tokens for r in eight.generate(prompts, 10)]
gcs = [r.tokens for r in eight.generate(prompts, 10, spec=spec.SpecConfig(3, 2, 6))]
emb = eight.params["embed"]["embedding"].sharding
# the bytes a device holds, as the load's fit check predicts them and as placed
from jaxspec import engine as E
shard_bytes = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
pred = E.param_bytes_per_device(eight.cfg, dcfg, jnp.float32, eight.mesh, eight.rules,
                                E.expert_layout(eight.cfg, eight.expert_impl), "replicated")
placed = (shard_bytes(eight.params), shard_bytes((eight.draft.params, eight.draft.d2t, eight.draft.embed)))
print(json.dumps({"devices": len(jax.devices()), "err": float(np.abs(a - b).max() / np.abs(a).max()),
                  "same": ga == gb, "spec_same": gs == ga, "chunked_same": gc == ga and gcs == ga,
                  "embed_spec": str(emb.spec),
                  "expert_spec": str(eight.params["layers"]["moe"]["gate"].sharding.spec),
                  "bytes": [list(pred), list(placed), shard_bytes(one.params)]}))
"""


def test_eight_device_mesh_matches_one_device(tmp_path):
    """Target sharded over 8 fake CPU devices (heads, experts, vocab) gives the single-device result,
    plain and speculative (draft replicated on every device)."""
    env = cpu_env.fake_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, str(tmp_path), ROOT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 8
    assert res["err"] < 1e-5
    assert res["same"]
    assert res["spec_same"]  # speculative greedy on the mesh equals plain greedy
    assert res["chunked_same"]  # prefill in chunks of 2 tokens changes nothing
    assert "model" in res["embed_spec"] and "model" in res["expert_spec"]
    # the load's fit check predicts the bytes each device holds (target, draft with the embedding's copy)
    pred, placed, whole = res["bytes"]
    assert pred == placed and pred[0] < whole, res["bytes"]


def test_plain_and_speculative_caches_get_the_same_slot_count(pair):
    """The attention kernel's split plan follows the cache's slot count, so a verify row has the decode
    step's bits only where plain decoding and speculation size their caches alike: they do for any tree
    whose slack (draft tokens + steps + 2) fits `loop.SHARED_SLACK`, and each cache holds what its
    method writes. The engine's plain cache is `Plain.cache_length`'s, short of the shared slack only
    at the model's context limit."""
    from jaxspec import decode, loop
    from jaxspec import spec as spec_loop
    from jaxspec.engine import ContextLengthError
    from jaxspec.spec import SpecConfig

    _, engine = pair
    trees = [SpecConfig(3, 1, 4), SpecConfig(4, 2, 8), SpecConfig(6, 4, 16), SpecConfig(8, 8, 48)]
    for max_new in (1, 17, 64, 500):
        plain = decode.Plain(engine.model, None, max_new)
        for prompt in range(1, 2200, 7):
            slots = plain.cache_length(prompt)
            assert slots % 64 == 0 and slots >= prompt + max_new + 1
            for tree in trees:
                slack = tree.num_draft_tokens + tree.num_steps + 2
                target, draft = spec_loop.cache_lengths(prompt, max_new, tree)
                assert target >= prompt + max_new + slack and target % 64 == 0
                if slack <= loop.SHARED_SLACK:
                    assert target == slots, (prompt, max_new, tree)
            # a tree with more slack than that gets more slots
            target, _ = spec_loop.cache_lengths(prompt, max_new, SpecConfig(8, 8, 64))
            assert target >= prompt + max_new + 74
    limit = engine.cfg.max_position_embeddings  # 512
    for n, max_new in ((10, 20), (300, 150), (400, limit - 401)):
        S = engine.pad_prompts([[5] * n], max_new)[2]
        assert S == (decode.Plain(engine.model, None, max_new).cache_length(n) if n + max_new + 64 <= limit else limit)
    with pytest.raises(ContextLengthError, match=f"needs 576 positions; the model supports {limit}"):
        engine.pad_prompts([[5] * 400], limit - 400)


def test_top_level_names():
    """The README's Python section imports from the package itself."""
    import jaxspec
    from jaxspec import Engine as E
    from jaxspec import SamplingParams
    from jaxspec import SpecConfig as SC
    from jaxspec.engine import Engine
    from jaxspec.sampling import SamplingParams as SP
    from jaxspec.spec import SpecConfig

    assert E is Engine and SC is SpecConfig and SamplingParams is SP
    with pytest.raises(AttributeError, match="no attribute 'generate_fast'"):
        _ = jaxspec.generate_fast


def test_a_model_too_large_for_the_devices_is_refused_before_anything_is_read(pair, tmp_path, monkeypatch):
    """Engine.load compares the parameters' bytes a device would hold with what JAX may allocate there (a
    GPU's limit; the CPU reports none) and refuses a model that cannot fit before reading a leaf, naming the
    checkpoint, the bytes needed and the limit; one that fits at exactly the limit loads."""
    from jaxspec import engine as E

    _, loaded = pair
    path = loaded.path
    need = sum(x.nbytes for x in jax.tree.leaves(loaded.params))
    monkeypatch.setattr(E, "device_memory_limit", lambda mesh: (need - 1, "Test GPU"))
    read = []
    real_load = E.load_target_params
    monkeypatch.setattr(E, "load_target_params", lambda *a, **k: read.append(1) or real_load(*a, **k))
    with pytest.raises(E.DeviceMemoryError) as err:
        Engine.load(path, dtype="float32")
    msg = str(err.value)
    assert not read
    for part in (path, "Test GPU", f"expected at most {need - 1} bytes a device, found {need}", "--num-devices"):
        assert part in msg, msg
    monkeypatch.setattr(E, "device_memory_limit", lambda mesh: (need, "Test GPU"))
    assert (
        Engine.load(path, dtype="float32").generate([[3, 4, 5]], 2)[0].tokens
        == loaded.generate([[3, 4, 5]], 2)[0].tokens
    )
    assert read
