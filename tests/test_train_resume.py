"""examples/train.py's checkpoint folder rules (issue 49, items 4 and 5): a folder holding an
earlier run's steps is refused without --resume or --overwrite; --resume falls back over a damaged
latest step (warning with the step, its path and the reason; the step moved aside, not deleted);
every refusal names the step and its path, and the command line ends without tracebacks.

One short run (2 dense steps, a checkpoint after each) is made first; the other runs reuse its
compiled programs (in-process) or stop before compiling (the command-line one)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))


def _load_train():
    spec = importlib.util.spec_from_file_location("jax_dsa_example_train_resume",
                                                  EXAMPLES / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


train = _load_train()

COMMON = ["--model", "glm5-tiny", "--batch", "2", "--seq-len", "128", "--steps", "4",
          "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1", "--corpus-mb", "0.5",
          "--dense-warmup-steps", "4", "--save-every", "1", "--no-progress"]


def _copy(src, tmp_path, name) -> pathlib.Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _damage(step_dir: pathlib.Path, how: str):
    if how == "no_state":
        shutil.rmtree(step_dir / "state")
    elif how == "meta_not_json":
        (step_dir / "meta" / "metadata").write_text("{bad")
    elif how == "meta_wrong":
        meta = json.loads((step_dir / "meta" / "metadata").read_text())
        del meta["data_position"]
        (step_dir / "meta" / "metadata").write_text(json.dumps(meta))
    elif how == "truncated_arrays":
        for f in (step_dir / "state").rglob("*"):
            if f.is_file() and f.parent.name == "d":
                os.truncate(f, 10)
    else:
        raise ValueError(how)


def _refusal_and_overwrite(src, tmp_path):
    """Without --resume a folder with an earlier run's steps is refused before any work, naming
    the folder and its steps, and left as it was; --overwrite replaces them."""
    ckpt = _copy(src, tmp_path, "refused")
    before = _snapshot(ckpt)
    with pytest.raises(train.CheckpointError) as info:
        train.main(COMMON + ["--checkpoint-dir", str(ckpt), "--stop-at-step", "1"])
    text = str(info.value)
    assert str(ckpt) in text and "[1, 2]" in text and "--resume" in text, text
    assert "--overwrite" in text
    assert _snapshot(ckpt) == before  # nothing deleted, nothing written
    for bad in (["--overwrite"], ["--overwrite", "--resume", "--checkpoint-dir", str(ckpt)]):
        with pytest.raises(SystemExit):
            train.parse_args(COMMON + bad)
    metrics = train.main(COMMON + ["--checkpoint-dir", str(ckpt), "--stop-at-step", "1",
                                   "--overwrite"])
    assert metrics["steps"] == 1 and metrics["resumed_from_step"] is None
    assert sorted(os.listdir(ckpt)) == ["1"]
    meta = json.loads((ckpt / "1" / "meta" / "metadata").read_text())
    assert meta["step"] == 1 and len(meta["history"]["train_loss"]) == 1


def _fallback(src, earlier, tmp_path, how, reason):
    """--resume over a damaged step 2: a warning naming step 2, its path and the reason; step 1
    restored and step 2 trained again exactly as the first time; the damaged step moved aside to
    2.damaged, byte for byte."""
    ckpt = _copy(src, tmp_path, how)
    _damage(ckpt / "2", how)
    damaged = _snapshot(ckpt / "2")
    with pytest.warns(train.CheckpointWarning) as caught:
        metrics = train.main(COMMON + ["--checkpoint-dir", str(ckpt), "--stop-at-step", "2",
                                       "--resume"])
    (warning,) = [w for w in caught if issubclass(w.category, train.CheckpointWarning)]
    text = str(warning.message)
    assert "step 2" in text and str(ckpt / "2") in text and "resuming from step 1" in text, text
    assert re.search(reason, text), text
    assert str(ckpt / "2.damaged") in text
    assert metrics["resumed_from_step"] == 1 and metrics["steps"] == 2
    np.testing.assert_allclose(metrics["train_loss"], earlier["train_loss"], rtol=1e-6)
    assert sorted(os.listdir(ckpt)) == ["1", "2", "2.damaged"]
    assert _snapshot(ckpt / "2.damaged") == damaged


def _other_settings(src, tmp_path):
    ckpt = _copy(src, tmp_path, "settings")
    with pytest.raises(train.CheckpointError) as info:
        train.main(COMMON + ["--checkpoint-dir", str(ckpt), "--resume", "--lr", "1e-3"])
    text = str(info.value)
    assert "step 2" in text and str(ckpt / "2") in text and "'lr'" in text, text


def _no_step_restores_on_the_command_line(src, tmp_path):
    """Exit status 2, one message naming every step, its path and reason, no traceback
    (tensorstore's "Event loop is closed" ones included), nothing moved."""
    ckpt = _copy(src, tmp_path, "none")
    _damage(ckpt / "2", "truncated_arrays")
    _damage(ckpt / "1", "meta_not_json")
    before = _snapshot(ckpt)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train.py"), *COMMON, "--checkpoint-dir", str(ckpt),
         "--resume"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "Event loop is closed" not in out, out
    assert f"step 2 at {ckpt / '2'}: state: ValueError" in out, out
    assert f"step 1 at {ckpt / '1'}: meta: JSONDecodeError" in out, out
    assert "nothing was moved or deleted" in out
    assert _snapshot(ckpt) == before


def test_checkpoint_folder_refusal_resume_fallback_and_errors(tmp_path):
    """One test, so that one process compiles the train step once (pytest-xdist would give
    separate tests separate workers, each compiling): an earlier run's steps 1 and 2, then each
    rule on a copy of them."""
    src = tmp_path / "earlier"
    earlier = train.main(COMMON + ["--checkpoint-dir", str(src), "--stop-at-step", "2"])
    assert sorted(os.listdir(src)) == ["1", "2"]
    _refusal_and_overwrite(src, tmp_path)
    for how, reason in (("no_state", "state: KeyError"), ("meta_not_json", "meta: JSONDecodeError"),
                        ("meta_wrong", r"meta lacks \['data_position'\]"),
                        ("truncated_arrays", "state: ValueError")):
        _fallback(src, earlier, tmp_path, how, reason)
    _other_settings(src, tmp_path)
    _no_step_restores_on_the_command_line(src, tmp_path)
