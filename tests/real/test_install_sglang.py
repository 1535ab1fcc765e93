"""The SGLang installer beyond the contract both installers keep (``test_install.py``): a machine
without room for a fresh install skips the tests, naming why; and the ``sgl_kernel`` stand-in is
the one deviation, with the one kernel the CPU serving path calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.real import install_sglang

pytestmark = [pytest.mark.realsglang]


def test_a_fresh_install_without_room_exits_75_with_one_line_before_pip_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A CI machine with too little disk for the ≈6 GB venv: the tests skip, naming why; pip never starts."""
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(install_sglang.shutil, "disk_usage", lambda p: real(p)._replace(free=3 * 2**30))
    monkeypatch.setattr(install_sglang, "_pip", lambda *a, **k: pytest.fail("pip ran without room"))
    assert install_sglang.main(["--dir", str(tmp_path / "rs")]) == 75
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("realsglang: ")]
    assert len(err) == 1 and err[0].startswith("real SGLang unavailable (disk): disk: 3.0 GiB free under"), err
    assert install_sglang.ready(tmp_path / "rs") is None
    assert (install_sglang.unavailable_reason(tmp_path / "rs") or "").startswith("disk: 3.0 GiB free")


@pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")  # the tests' venv has torch without numpy
def test_the_sgl_kernel_stand_in_fills_the_request_to_token_table_and_names_a_missing_kernel() -> None:
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("sgl_kernel_cpu", install_sglang.SHIM_SRC)
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    table = torch.zeros((4, 8), dtype=torch.int32)
    # request 2 gets slots 10, 11, 12 at positions 0-2; request 0 gets 20, 21 at positions 5-6
    shim.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), table, torch.tensor([0, 5]), torch.tensor([3, 7]),
                                      torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64), 8)
    assert table[2, :3].tolist() == [10, 11, 12] and table[0, 5:7].tolist() == [20, 21]
    assert int(table.count_nonzero()) == 5
    with pytest.raises(NotImplementedError, match="'fused_experts_cpu' is not available"):
        shim.fused_experts_cpu()
