"""Engine builds at real sizes in a fresh process (peak RSS and the cache's records back), and a
session cache of them: tests/test_real_sizes.py and tests/test_engines_real_sizes.py need the same
static 512 px / 1024 px engines, built once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_BUILD = textwrap.dedent(
    """
    import json, resource, sys
    args = json.loads(sys.argv[1])
    if args.get("cli"):
        import contextlib, io
        from sd_accel.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(args["cli"])
        assert rc == 0, out.getvalue()
    else:
        from sd_accel import build_engines, load_pipeline
        pipe = load_pipeline(args["model"])
        build_engines(pipe, args["preset"], backend=args["backend"], precision=args.get("precision") or "auto",
                      engine_dir=args["engine_dir"], progress=False)
    from sd_accel import EngineCache
    records = [{"component": r.key.component, "backend": r.key.backend, "precision": r.key.precision,
                "profile": r.key.profile, "status": r.status, "validation": r.validation,
                "size_bytes": r.size_bytes} for r in EngineCache(args["engine_dir"]).list()]
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child of a pytest that grew
    # (an in-process SD 1.5 export earlier in the suite) would report pytest's peak
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
    peak = int(hwm[0].split()[1]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"peak_bytes": peak, "records": records}))
    """
)


def build_in_subprocess(tmp_path: Path, **args) -> dict:
    """Run one build in a fresh Python; its peak RSS and the cache's records."""
    args.setdefault("engine_dir", str(tmp_path / "engines"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _BUILD, json.dumps(args)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


