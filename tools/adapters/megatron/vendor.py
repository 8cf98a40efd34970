"""Build Triton-only wheels of mamba_ssm and causal_conv1d from their sdists (no CUDA build, no compiled extension).

Megatron-Core's Mamba mixer imports mamba_ssm's Triton gated norm / chunked-scan ops and causal_conv1d's Triton
varlen-states helper; both packages are published as sdists whose top-level `__init__` imports a compiled
extension. This tool copies the Triton Python files verbatim into a pure-Python wheel whose `__init__` only sets
`__version__` (causal_conv1d's also sets the CUDA-only `causal_conv1d_fn` to None, exactly what Megatron's own
`except ImportError` branch does when the package is absent). The same wheels install on CPU and on the GPU image.

    python -m hybridqual.adapters.megatron.vendor SDIST_DIR OUT_DIR     # writes mamba_ssm-*.whl and causal_conv1d-*.whl
"""
from __future__ import annotations

import base64
import hashlib
import io
import sys
import tarfile
import zipfile
from pathlib import Path

# package -> (sdist name prefix, files kept relative to the package dir; a trailing "/*.py" keeps a folder's modules)
KEEP = {
    "mamba_ssm": ("mamba_ssm-", ["ops/__init__.py", "ops/triton/*.py", "utils/__init__.py", "utils/determinism.py",
                                 "utils/torch.py"]),
    "causal_conv1d": ("causal_conv1d-", ["causal_conv1d_varlen.py"]),
}
INIT = {
    "mamba_ssm": '__version__ = "{v}"\n# Triton-only install by hybridqual (tools/adapters/megatron/vendor.py): the compiled\n'
                 '# selective-scan extension and the modules importing it are left out.\n',
    "causal_conv1d": '__version__ = "{v}"\n# Triton-only install by hybridqual (tools/adapters/megatron/vendor.py): the CUDA\n'
                     '# extension is not built, so its functions are absent, as Megatron handles it.\n'
                     'causal_conv1d_fn = None\ncausal_conv1d_update = None\n',
}


def _wanted(rel: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.endswith("/*.py"):
            folder = p[:-len("*.py")]
            if rel.startswith(folder) and "/" not in rel[len(folder):] and rel.endswith(".py"):
                return True
        elif rel == p:
            return True
    return False


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(sdist: Path, package: str, out_dir: Path) -> Path:
    """One Triton-only wheel for `package` from its sdist tarball; returns the wheel's path."""
    prefix, patterns = KEEP[package]
    version = sdist.name[len(prefix):-len(".tar.gz")]
    files: dict[str, bytes] = {f"{package}/__init__.py": INIT[package].format(v=version).encode()}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            parts = m.name.split("/", 2)         # <sdist root>/<package>/<rel>
            if len(parts) == 3 and parts[1] == package and m.isfile() and _wanted(parts[2], patterns):
                files[f"{package}/{parts[2]}"] = tar.extractfile(m).read()
    if len(files) < 2:
        raise SystemExit(f"{sdist}: none of {patterns} found under {package}/")
    dist = f"{package}-{version}"
    meta = (f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {version}\n"
            f"Summary: Triton-only pieces of {package} {version} (hybridqual tools/adapters/megatron/vendor.py)\n").encode()
    wheel = b"Wheel-Version: 1.0\nGenerator: hybridqual-vendor\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{dist}.dist-info/METADATA"] = meta
    files[f"{dist}.dist-info/WHEEL"] = wheel
    record = [_record_line(n, d) for n, d in sorted(files.items())] + [f"{dist}.dist-info/RECORD,,"]
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{dist}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))   # reproducible bytes
            z.writestr(info, files[name], zipfile.ZIP_DEFLATED)
    path.write_bytes(buf.getvalue())
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1].strip())
        return 2
    sdists, out = Path(args[0]), Path(args[1])
    for package, (prefix, _) in KEEP.items():
        found = sorted(sdists.glob(f"{prefix}*.tar.gz"))
        if len(found) != 1:
            raise SystemExit(f"{sdists}: expected one {prefix}*.tar.gz, found {[f.name for f in found]}")
        print(build_wheel(found[0], package, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
