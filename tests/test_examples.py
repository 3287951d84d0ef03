"""The examples and the README's snippets, run as a user would run them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import circle_loss

ROOT = Path(__file__).resolve().parents[1]


def run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_train_digits_learns(tmp_path):
    out = run([sys.executable, "examples/train_digits.py", "--out", str(tmp_path / "digits.png")])
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"recall@1 before ([0-9.]+) after ([0-9.]+)", last)
    assert match, last
    before, after = map(float, match.groups())
    assert after >= before + 0.05 and after >= 0.95, last
    map_before, map_after = map(float, re.search(r"MAP@R before ([0-9.]+) after ([0-9.]+)", out).groups())
    assert map_after >= map_before + 0.2
    assert (tmp_path / "digits.png").stat().st_size > 10_000


def test_train_digits_with_a_memory_bank_learns():
    pytest.importorskip("pytorch_metric_learning")
    out = run([sys.executable, "examples/train_digits_memory.py"])
    before, after = map(float, re.fullmatch(r"recall@1 before ([0-9.]+) after ([0-9.]+)",
                                            out.strip().splitlines()[-1]).groups())
    assert after >= before + 0.05 and after >= 0.95, out
    map_before, map_after = map(float, re.search(r"MAP@R before ([0-9.]+) after ([0-9.]+)", out).groups())
    assert map_after >= map_before + 0.2


def test_train_digits_with_the_class_level_head_learns(tmp_path):
    out = run([sys.executable, "examples/train_digits_classes.py", "--out", str(tmp_path / "classes.png")])
    before, after = map(float, re.fullmatch(r"recall@1 before ([0-9.]+) after ([0-9.]+)",
                                            out.strip().splitlines()[-1]).groups())
    assert after >= before + 0.05 and after >= 0.95, out
    map_before, map_after = map(float, re.search(r"MAP@R before ([0-9.]+) after ([0-9.]+)", out).groups())
    assert map_after >= map_before + 0.3
    assert (tmp_path / "classes.png").stat().st_size > 10_000


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("form", ["loss", "anchor", "class"])
def test_train_digits_distributed_on_two_gloo_ranks(form, tmp_path):
    # As docs/distributed.md tells it: torchrun, two processes, gloo.
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "examples/train_digits_distributed.py", "--form", form, "--device", "cpu",
               "--out", str(tmp_path / "d.png")], env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert f"{form} form on 2 ranks" in out
    before, after = map(float, re.fullmatch(r"recall@1 before ([0-9.]+) after ([0-9.]+)",
                                            out.strip().splitlines()[-1]).groups())
    assert after >= before + 0.05 and after >= 0.95, out
    map_before, map_after = map(float, re.search(r"MAP@R before ([0-9.]+) after ([0-9.]+)", out).groups())
    assert map_after >= map_before + 0.3


def test_train_digits_compiled_step(tmp_path):
    out = run([sys.executable, "examples/train_digits.py", "--compile", "--epochs", "2", "--out", str(tmp_path / "d.png")])
    assert out.strip().splitlines()[-1].startswith("recall@1 before")


def test_cpp_program_prints_the_python_loss(tmp_path):
    """TorchScript and the AOTInductor package, both run from C++ with no Python."""
    out = run(["bash", "examples/cpp/run.sh"], env=dict(os.environ, WORK_DIR=str(tmp_path), PYTHON=sys.executable))
    python_loss = float(re.search(r"^python loss (\S+)$", out, re.M).group(1))
    cpp_loss = float(re.search(r"^loss (\S+)$", out, re.M).group(1))
    aoti_loss = float(re.search(r"^aoti loss (\S+)$", out, re.M).group(1))
    assert cpp_loss == pytest.approx(python_loss, rel=1e-6)
    assert aoti_loss == pytest.approx(python_loss, rel=1e-6)


class EmbeddingLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(32, 16)

    def forward(self, x, labels):
        return circle_loss.circle_loss(torch.nn.functional.normalize(self.head(x), dim=1), labels, 0.25, 64.0)


def export_dynamic(model, x, labels):
    batch = torch.export.Dim("batch", min=2)
    return torch.export.export(model, (x, labels), dynamic_shapes=({0: batch}, {0: batch}))


def test_torch_export_runs_and_matches_eager():
    model = EmbeddingLoss().eval()
    program = export_dynamic(model, torch.randn(100, 32), torch.randint(0, 5, (100,)))
    assert "torch.ops.circle.loss.default" in program.graph_module.code
    x, labels = torch.randn(150, 32), torch.randint(0, 5, (150,))  # another batch size
    torch.testing.assert_close(program.module()(x, labels), model(x, labels))


def inductor_compiler_links_shared_libstdcxx() -> bool:
    """Whether the C++ compiler AOTInductor builds with (CXX, else g++) finds
    a shared libstdc++. A compiler that finds only the static archive (the
    H200 image's /opt/gcc wrapper) links a private C++ runtime into the
    package torch builds, and loading that package into this process
    crashes it (seen there; with /usr/bin/g++ the same test passes). That is
    torch's build of the package, not this library's, whose CMake rules it out."""
    compiler = os.environ.get("CXX", "g++")
    try:
        found = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True)
    except OSError:  # no such compiler: AOTInductor could build nothing either
        return False
    return found.returncode == 0 and os.path.isabs(found.stdout.strip())


@pytest.mark.skipif(not inductor_compiler_links_shared_libstdcxx(),
                    reason="CXX finds no shared libstdc++: AOTInductor's own package would crash on load "
                           "(set CXX to a compiler with one, e.g. /usr/bin/g++)")
def test_aot_inductor_package_runs(tmp_path):
    model = EmbeddingLoss().eval()
    program = export_dynamic(model, torch.randn(100, 32), torch.randint(0, 5, (100,)))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    x, labels = torch.randn(120, 32), torch.randint(0, 5, (120,))
    torch.testing.assert_close(runner(x, labels), model(x, labels))


# Every Python snippet of the README and of the docs pages, named by page and number.
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = {
    f"{page.relative_to(ROOT)}#{k}": code
    for page in DOC_PAGES
    for k, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
}


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_doc_snippet_runs(name, tmp_path):
    run([sys.executable, "-c", SNIPPETS[name]], env=dict(os.environ, TMPDIR=str(tmp_path)))


def test_every_page_with_code_has_its_snippets_collected():
    pages = {name.split("#")[0] for name in SNIPPETS}
    assert {"README.md", "docs/usage.md", "docs/pml.md", "docs/distributed.md", "docs/deployment.md"} <= pages
