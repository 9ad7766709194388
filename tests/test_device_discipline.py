"""Device discipline, library-wide: every tensor factory in parallel/, core/ and rl/ names its
device (`device=`) or writes into an existing tensor (`out=`), so on CUDA nothing silently lands on
the CPU. `*_like` and `Tensor.new_*` follow their input and are fine. The walk is over the source
(ast), so it covers code paths no CPU test executes."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("parallel", "core", "rl")
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint", "eye", "linspace",
             "logspace", "as_tensor", "randperm", "empty_strided", "scalar_tensor", "range", "tril_indices",
             "triu_indices"}


def factory_calls_without_device(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    """(line, "torch.NAME") of every `torch.NAME(...)` factory call in `source` with neither a
    `device=` nor an `out=` keyword (a `**kwargs` splat is trusted to carry it)."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        kws = {k.arg for k in node.keywords}
        if "device" in kws or "out" in kws or None in kws:
            continue
        bad.append((node.lineno, f"torch.{f.attr}"))
    return bad


def library_violations() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for fn in sorted(files):
                if fn.endswith(".py"):
                    path = os.path.join(dirpath, fn)
                    with open(path, encoding="utf-8") as f:
                        src = f.read()
                    rel = os.path.relpath(path, ROOT)
                    out += [f"{rel}:{line}: {name}(...) names no device" for line, name in
                            factory_calls_without_device(src, rel)]
    return out


def test_the_checker_finds_what_it_should():
    src = ("import torch\n"
           "a = torch.zeros(3)\n"  # 2: bad
           "b = torch.zeros(3, device=x.device)\n"
           "c = torch.zeros_like(x)\n"
           "d = x.new_zeros(3)\n"
           "e = torch.arange(4, dtype=torch.long)\n"  # 6: bad
           "f = torch.tensor([1.0], device='cpu')\n"
           "g = torch.randn(2, generator=gen)\n"  # 8: bad
           "h = torch.full((2,), 1.0, **kw)\n"
           "i = torch.empty(2, out=y)\n")
    assert factory_calls_without_device(src) == [(2, "torch.zeros"), (6, "torch.arange"), (8, "torch.randn")]


def test_no_tensor_factory_without_device_in_the_library():
    bad = library_violations()
    assert not bad, "tensor factories without device= (use device=x.device, new_*, *_like or device='cpu'):\n" + \
        "\n".join(bad)


if __name__ == "__main__":  # pragma: no cover - a listing for humans
    print("\n".join(library_violations()) or "clean")
    pytest.main([__file__, "-q"])
