"""The suite's compilation cache (tests/compile_cache.py): where it lives, the switch, and the pruning."""

import os

import compile_cache


def _write(path, name, size, mtime):
    p = os.path.join(path, name)
    with open(p, "wb") as f:
        f.write(b"x" * size)
    os.utime(p, ns=(mtime, mtime))
    return p


def test_prune_deletes_the_oldest_entries_down_to_half_the_limit(tmp_path):
    paths = [_write(tmp_path, f"e{i}", 100, 10**9 * (i + 1)) for i in range(6)]  # e0 oldest
    assert compile_cache.prune(str(tmp_path), limit=600) == 0  # at the limit: nothing goes
    assert all(os.path.exists(p) for p in paths)
    assert compile_cache.prune(str(tmp_path), limit=500) == 4  # 600 > 500: down to <= 250 bytes
    assert sorted(os.listdir(tmp_path)) == ["e4", "e5"]


def test_prune_of_a_missing_directory_is_a_no_op(tmp_path):
    assert compile_cache.prune(str(tmp_path / "absent")) == 0


def test_configure_keeps_the_callers_directory_and_honours_the_switch(monkeypatch, tmp_path):
    import jax

    before = jax.config.jax_compilation_cache_dir  # configure() points this process's JAX at the directory too
    try:
        monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
        monkeypatch.delenv(compile_cache.SWITCH, raising=False)
        assert compile_cache.configure() == str(tmp_path / "mine")
        assert os.environ[compile_cache.ENV] == str(tmp_path / "mine")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")

        monkeypatch.delenv(compile_cache.ENV)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert compile_cache.configure() == str(tmp_path / "xdg" / "jaxspec" / "xla-tests")

        monkeypatch.setenv(compile_cache.SWITCH, "0")
        monkeypatch.delenv(compile_cache.ENV)
        assert compile_cache.configure() is None and compile_cache.ENV not in os.environ
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_this_run_uses_the_cache_unless_switched_off():
    import jax

    expected = None if os.environ.get(compile_cache.SWITCH) == "0" else os.environ.get(compile_cache.ENV)
    assert jax.config.jax_compilation_cache_dir == expected
