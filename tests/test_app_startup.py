"""Start-up: `python app.py --model <folder>` with a folder that holds no usable model ends
with one clear line on stderr and exit status 2, as the CLI does, never a traceback."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "assets" / "target"


def bad_folders(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Folders that are not usable checkpoints, and a phrase each message must hold."""
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_config = tmp_path / "bad-config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text(json.dumps({"hidden_size": "wide"}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    shutil.copy(TARGET / "config.json", corrupt / "config.json")
    (corrupt / "model.safetensors").write_bytes(os.urandom(256))
    return {"missing": (tmp_path / "no-such-folder", "no-such-folder"), "empty": (empty, "config.json"),
            "bad-config": (bad_config, "gated_deltanet"), "corrupt": (corrupt, "safetensors")}


@pytest.mark.parametrize("case", ["missing", "empty", "bad-config", "corrupt"])
def test_a_bad_model_folder_is_one_line_and_status_2(tmp_path, capsys, case):
    import app

    folder, phrase = bad_folders(tmp_path)[case]
    assert app.main(["--model", str(folder), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot load the model:") and "\n" not in err and phrase in err, err


def test_the_app_process_exits_2_without_a_traceback(tmp_path):
    folder, _ = bad_folders(tmp_path)["corrupt"]
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(ROOT / "app.py"), "--model", str(folder), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert done.stderr.startswith("error: cannot load the model:")
