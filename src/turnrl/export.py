"""``turnrl export``: a trained iteration as a directory that transformers and vLLM load.

Outer iteration n's adapter is a delta on the base with adapters 0..n−1 merged, so the
policy after iteration n is base + adapters 0..n. The export merges them in float32
(:func:`turnrl.models.merge_adapters`), casts to the run's ``model.dtype`` and saves a
Hugging Face directory: ``config.json``, ``generation_config.json``, safetensors
weights, the tokenizer with its chat template, and ``turnrl_export.json`` (where it
came from). ``adapter_only`` copies the peft adapter of iteration 0 instead (the only
adapter that is a delta on the base itself).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from turnrl.config import load_run_config
from turnrl.models import DTYPES, load_model, merge_adapters
from turnrl.rundir import RunDir, contained, refuse_links


def _adapters(run: RunDir, iteration: int) -> list[Path]:
    if iteration < 0:
        raise ValueError(f"--iteration must be >= 0 (got {iteration})")
    return run.adapters_through(iteration, purpose=f"--iteration {iteration}")


def _into_place(out: Path, build) -> Path:
    """Build the export in a temporary sibling directory, then rename it to ``out``."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory; choose a new --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        build(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export(run_dir: str | Path, iteration: int, out: str | Path, *, adapter_only: bool = False) -> Path:
    """Write iteration ``iteration`` of the run in ``run_dir`` to ``out``; returns ``out``."""
    run, out = RunDir(Path(run_dir)), Path(out)
    if not run.config.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_run_config(run.config)
    dirs = _adapters(run, iteration)
    info = {
        "run_dir": str(run.root.resolve()),
        "iteration": iteration,
        "base_model": cfg.model.name,
        "adapters": [d.name for d in dirs],
        "dtype": cfg.model.dtype,
    }

    if adapter_only:
        if iteration != 0:
            raise ValueError(
                f"--adapter-only with --iteration {iteration}: that adapter is a delta on the base with adapters"
                f" 0..{iteration - 1} merged, so alone it does not give the policy; drop --adapter-only to export"
                " the merged model (or export --iteration 0)"
            )

        source = contained(dirs[0], run.root, "the adapter")  # a link planted in the run is not followed out
        refuse_links(source)

        def build_adapter(tmp: Path) -> None:
            shutil.copytree(source, tmp, dirs_exist_ok=True, symlinks=True)
            (tmp / "turnrl_export.json").write_text(json.dumps({**info, "kind": "adapter"}, indent=2))

        return _into_place(out, build_adapter)

    def build_merged(tmp: Path) -> None:
        model_cfg = cfg.model.model_copy(update={"dtype": "float32", "device": "cpu"})
        base, tokenizer = load_model(model_cfg, seed=cfg.seed)
        merged = merge_adapters(base, dirs).to(DTYPES[cfg.model.dtype])
        merged.config.use_cache = True
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)  # with the chat template
        (tmp / "turnrl_export.json").write_text(json.dumps({**info, "kind": "merged"}, indent=2))

    return _into_place(out, build_merged)
