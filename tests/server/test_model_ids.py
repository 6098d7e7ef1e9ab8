"""MODEL and --tokenizer as Hugging Face ids (issue 33), resolved through a hub cache the test lays out on
disk the way huggingface_hub does (no network here: HF_HUB_OFFLINE, or a hub endpoint nobody answers)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cpuinfer.config import default_model_path
from cpuinfer.model_loader import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_repo(cache: str, repo_id: str, files: dict[str, str | bytes], commit: str = COMMIT, ref: str = "main") -> str:
    """A repository snapshot in a huggingface_hub cache: models--owner--name/{refs/<ref>, snapshots/<commit>/...}.
    A str value is the path of a file to link there; bytes are the file's content."""
    root = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(root, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", ref), "w") as f:
        f.write(commit)
    for name, value in files.items():
        target = os.path.join(snap, name)
        if isinstance(value, bytes):
            with open(target, "wb") as f:
                f.write(value)
        else:
            os.symlink(value, target)
    return snap


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


def test_a_local_path_is_itself(tmp_path):
    assert hub.resolve_model(str(tmp_path)) == str(tmp_path)


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path, offline):  # noqa: ARG001 - fixture sets offline
    snap = add_repo(str(tmp_path), "org/tiny", {"config.json": b"{}", "model.safetensors": b""})
    assert hub.resolve_model("org/tiny", download_dir=str(tmp_path)) == snap
    assert hub.resolve_model("org/tiny", revision=COMMIT, download_dir=str(tmp_path)) == snap
    with pytest.raises(ValueError, match=r"'org/tiny' at revision 'v2': not in the Hugging Face cache"):
        hub.resolve_model("org/tiny", revision="v2", download_dir=str(tmp_path))


def test_a_cached_gguf_repository_resolves_to_its_file(tmp_path, offline):  # noqa: ARG001
    snap = add_repo(str(tmp_path), "org/one-gguf", {"m.Q4_1.gguf": default_model_path()})
    assert hub.resolve_model("org/one-gguf", download_dir=str(tmp_path)) == os.path.join(snap, "m.Q4_1.gguf")
    add_repo(str(tmp_path), "org/two-gguf", {"a.gguf": b"", "b.gguf": b""})
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files"):
        hub.resolve_model("org/two-gguf", download_dir=str(tmp_path))


def test_not_found_offline_names_the_id_the_cache_and_why(tmp_path, offline):  # noqa: ARG001
    with pytest.raises(ValueError) as e:
        hub.resolve_model("org/absent", download_dir=str(tmp_path), flag="--tokenizer")
    msg = str(e.value)
    assert "--tokenizer 'org/absent'" in msg and str(tmp_path) in msg and "HF_HUB_OFFLINE is set" in msg


def test_not_found_with_the_hub_unreachable_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nobody listens on port 9
    with pytest.raises(ValueError, match="the hub could not be reached"):
        hub.resolve_model("org/absent", download_dir=str(tmp_path))


@pytest.mark.parametrize("name", ["./org/absent", "/nope/x", "absent.gguf", "a/b/c"])
def test_a_missing_path_that_is_no_hub_id_is_no_such_file(name):
    with pytest.raises(ValueError, match="no such file or directory"):
        hub.resolve_model(name)


def serve(*args: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cpuinfer", "serve", "--port", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_serve_refuses_an_unknown_id_before_uvicorn_starts(tmp_path):
    from .conftest import server_env

    env = server_env(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    out = serve("HuggingFaceTB/SmolLM2-135M-Instruct", env=env)
    assert out.returncode != 0
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct': not in the Hugging Face cache" in out.stderr
    assert os.path.join(str(tmp_path), "hub") in out.stderr
    assert "Uvicorn running" not in out.stdout + out.stderr


def test_serve_a_hub_id_from_the_cache_with_a_tokenizer_id(tmp_path):
    """The served name is the id as given; --tokenizer's chat template is the one used."""
    import httpx

    from cpuinfer.model_loader import load_model_spec

    from .conftest import running_server, server_env

    cache = os.path.join(tmp_path, "hub")
    add_repo(cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {"SmolLM2.Q4_1.gguf": default_model_path()})
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    load_model_spec(default_model_path()).tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text('{"chat_template": "TOKENIZER-TEMPLATE {{ messages[0].content }}"}')
    add_repo(
        cache,
        "org/tok",
        {
            "tokenizer.json": str(tok_dir / "tokenizer.json"),
            "tokenizer_config.json": str(tok_dir / "tokenizer_config.json"),
        },
    )
    env = server_env(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    with running_server("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "--tokenizer", "org/tok", env=env) as s:
        models = httpx.get(s.v1 + "/models", headers=s.headers()).json()
        assert [m["id"] for m in models["data"]] == ["HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"]
        body = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
        ids = httpx.post(s.url + "/tokenize", json=body, headers=s.headers()).json()["tokens"]
        text = httpx.post(s.url + "/detokenize", json={"tokens": ids}, headers=s.headers()).json()["prompt"]
        assert text == "TOKENIZER-TEMPLATE hi"


def test_generate_takes_a_hub_id_too(tmp_path):
    from .conftest import server_env

    add_repo(str(tmp_path / "hub"), "org/smol-gguf", {"smol.Q4_1.gguf": default_model_path()})
    env = server_env(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "cpuinfer", "generate", "The capital of France is", "--model", "org/smol-gguf"]
    out = subprocess.run([*cmd, "--max-tokens", "3", "--temperature", "0"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
