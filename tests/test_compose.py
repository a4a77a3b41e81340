"""The deployment files: compose.yaml, the Dockerfiles, .dockerignore, .env.example and the compose
snippets in docs/deploy.md.

The properties the deployment promises are read off the files: services, profiles, GPU
reservation, healthchecks, grace periods, Redis never on a public interface, every worker setting
reachable from .env, the api service (batchery serve) in front of the workers with its keys and its
files volume, and the keys never in a worker's environment. Then Debian's ``docker-compose``
(1.29) validates the files with ``docker-compose config``. It parses the files without a Docker
engine. CI must have it (``apt-get install -y docker-compose``): under ``CI=true`` a missing binary
fails these tests. Elsewhere they are skipped."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from batchery.contract.settings import Settings, env_variables

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"

BATCHERY_SERVICES = ("worker", "worker-cpu", "cli")  # the services that run batchery with the shared env
API_PREFIX = "BATCHERY_API__"  # batchery serve's own settings: the api service's, no worker's
API_FIXED_BY_COMMAND = {"BATCHERY_API__HOST", "BATCHERY_API__PORT"}  # the api service's command sets them
# BATCHERY_* names compose uses that are not Settings fields
COMPOSE_ONLY = {
    "BATCHERY_MODEL_CACHE",  # read by engine/loader.py from the environment
    "BATCHERY_IMAGE_TAG",  # image tags
    "BATCHERY_STOP_GRACE_PERIOD",  # docker's stop_grace_period
}
GRACE_MARGIN_S = 30  # time to hand unfinished messages back to Redis after the drain


# -- helpers -----------------------------------------------------------------------------------------
_INTERP = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's variable interpolation over a loaded YAML tree: ``${VAR:-default}``, ``${VAR}``,
    ``$VAR``; ``$$`` is a literal ``$``. ``env`` empty (the default): what ships, with no .env."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        got = env.get(name)
        if op == ":-":
            return got if got else default
        if op == "-":
            return default if got is None else got
        return got or ""

    return _INTERP.sub(sub, value)


def referenced_variables(text: str) -> set[str]:
    """Variables compose interpolates in ``text`` (``$$`` escapes are the container's, not compose's)."""
    return {m.group(1) or m.group(4) for m in _INTERP.finditer(text) if m.group(0) != "$$"}


def duration_s(value) -> float:
    """A compose duration ("660s", "11m", "1m30s", "1h") or a number of seconds, in seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a compose duration: {value!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def command_text(cmd) -> str:
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def setting_env_names() -> set[str]:
    """Every BATCHERY_* variable Settings reads (nested options with ``__``)."""
    return {var for var, _default, _meaning in env_variables()}


def worker_setting_env_names() -> set[str]:
    """The BATCHERY_* variables of the workers and the CLI: all but batchery serve's own."""
    return {v for v in setting_env_names() if not v.startswith(API_PREFIX)}


def env_example_entries() -> dict[str, str]:
    """``NAME -> value`` for every ``NAME=value`` line of .env.example, commented out or not,
    with inline comments stripped (as compose's .env parser does)."""
    entries = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            entries[m.group(1)] = re.split(r"\s+#", m.group(2), maxsplit=1)[0].strip()
    return entries


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_base(path: Path) -> str:
    """The image of the (last) FROM, with build-arg defaults substituted."""
    args, base = {}, None
    for word, rest in dockerfile_instructions(path):
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k.strip()] = v.strip().strip('"')
        if word == "FROM":
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), rest.split()[0])
    assert base, f"{path.name} has no FROM"
    return base


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            excluded = not negate
    return excluded


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw) -> dict:
    """compose.yaml as compose sees it with no .env and no BATCHERY_* variables in the shell."""
    return interpolate(raw)


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _published(ports) -> list[tuple[str | None, str]]:
    """``(host_ip, container_port)`` for each published port, short or long syntax."""
    out = []
    for p in ports or []:
        if isinstance(p, dict):
            out.append((p.get("host_ip"), str(p["target"])))
            continue
        fields = str(p).split(":")
        host_ip = fields[0] if len(fields) == 3 else None
        out.append((host_ip, fields[-1].split("/")[0]))
    return out


def _named_volume(service: dict, target: str, compose: dict) -> str:
    for v in service.get("volumes", []):
        src, _, rest = v.partition(":")
        if rest.split(":")[0] == target:
            assert src in (compose.get("volumes") or {}), f"{src!r} mounted on {target} is not a named volume"
            return src
    raise AssertionError(f"nothing is mounted on {target}: {service.get('volumes')}")


# -- redis -------------------------------------------------------------------------------------------
def test_redis_is_redis7_with_aof_noeviction_healthcheck_and_named_volume(services, compose):
    redis = services["redis"]
    assert re.fullmatch(r"redis:7(\.[\w.-]+)?(-[\w.-]+)?", redis["image"]), redis["image"]
    cmd = command_text(redis["command"])
    assert re.search(r"--appendonly\s+yes\b", cmd), cmd
    assert re.search(r"--maxmemory-policy\s+noeviction\b", cmd), cmd
    assert "profiles" not in redis
    test = command_text(redis["healthcheck"]["test"])
    assert "redis-cli" in test and "ping" in test, test
    _named_volume(redis, "/data", compose)
    assert redis.get("restart") == "unless-stopped"


def test_redis_password_is_optional_and_applied_to_server_and_healthcheck(services):
    redis = services["redis"]
    cmd = command_text(redis["command"])
    # the shell in the container (not compose) expands it, only when set
    assert '${REDIS_PASSWORD:+--requirepass "$REDIS_PASSWORD"}' in cmd, cmd
    assert "REDISCLI_AUTH" in command_text(redis["healthcheck"]["test"])
    assert redis["environment"]["REDIS_PASSWORD"] == ""  # no password unless .env sets one


def test_nothing_is_published_on_a_public_interface(services):
    for name, svc in services.items():
        for host_ip, port in _published(svc.get("ports")):
            assert host_ip == "127.0.0.1", f"{name} publishes {port} on {host_ip or 'every interface'}"
        assert "network_mode" not in svc or svc["network_mode"] != "host", f"{name} uses the host network"
    assert [port for _, port in _published(services["redis"].get("ports"))] in ([], ["6379"])


# -- workers -----------------------------------------------------------------------------------------
def test_worker_runs_on_one_gpu_from_the_cuda_image(services):
    worker = services["worker"]
    assert "profiles" not in worker  # the default stack
    assert worker["build"]["context"] == "."
    dockerfile = ROOT / worker["build"].get("dockerfile", "Dockerfile")
    assert re.fullmatch(r"pytorch/pytorch:[\w.]+-cuda[\d.]+-cudnn\d+-(runtime|devel)", dockerfile_base(dockerfile))
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    assert devices[0]["driver"] == "nvidia"
    assert devices[0]["count"] == 1
    assert "gpu" in devices[0]["capabilities"]
    assert "device_ids" not in devices[0]


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_worker_service_lifecycle(services, compose, name):
    svc = services[name]
    assert command_text(svc.get("command") or []) in ("", "batchery worker")
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert svc["restart"] == "unless-stopped"
    test = svc["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL") and "batchery health" in command_text(test[1:]), test
    assert duration_s(svc["healthcheck"]["start_period"]) >= 120  # loading a model takes a while
    cache = svc["environment"]["BATCHERY_MODEL_CACHE"]
    _named_volume(svc, cache, compose)


def test_cpu_worker_is_in_the_cpu_profile_without_a_gpu(services):
    cpu = services["worker-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert "devices" not in str(cpu.get("deploy", {}))
    dockerfile = ROOT / cpu["build"]["dockerfile"]
    assert dockerfile_base(dockerfile).startswith("python:3.11")
    assert "download.pytorch.org/whl/cpu" in dockerfile.read_text()


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_stop_grace_period_outlasts_the_drain_and_the_default_deadline(services, name):
    svc = services[name]
    env = svc["environment"]
    task_timeout = float(env.get("BATCHERY_TASK_TIMEOUT") or Settings.model_fields["task_timeout"].default)
    shutdown_grace = float(env.get("BATCHERY_SHUTDOWN_GRACE") or Settings.model_fields["shutdown_grace"].default)
    stop = duration_s(svc["stop_grace_period"])
    # in-flight requests with the default deadline may finish before the drain ends ...
    assert shutdown_grace >= task_timeout, (shutdown_grace, task_timeout)
    # ... and docker does not SIGKILL the worker before it has handed the rest back to Redis
    assert stop >= shutdown_grace + GRACE_MARGIN_S, (stop, shutdown_grace)
    assert stop >= task_timeout + GRACE_MARGIN_S


# -- the api (batchery serve) -----------------------------------------------------------------------------
def test_api_serves_on_port_8000_in_front_of_the_workers(services, compose):
    api = services["api"]
    assert "profiles" not in api  # the default stack
    assert command_text(api["command"]) == "batchery serve --host 0.0.0.0 --port 8000"
    assert api["image"] == services["worker"]["image"]  # the same image: nothing more to build
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "deploy" not in api  # no GPU
    assert api["restart"] == "unless-stopped"
    assert [port for _, port in _published(api["ports"])] == ["8000"]
    test = api["healthcheck"]["test"]
    assert test[0] == "CMD" and command_text(test[1:]) == (
        "batchery health --live --quiet --url http://127.0.0.1:8000"
    ), test  # GET /healthz on the server itself
    assert duration_s(api["stop_grace_period"]) >= 15  # batchery serve gives open requests 10 s


def test_api_files_live_on_a_named_volume_every_replica_shares(services, compose):
    api = services["api"]
    storage = api["environment"]["BATCHERY_API__STORAGE_DIR"]
    assert storage == "/files"
    assert _named_volume(api, storage, compose) == "files"
    for word, rest in dockerfile_instructions(ROOT / "Dockerfile"):
        if word == "RUN" and "useradd" in rest:
            assert "/files" in rest and re.search(r"chown batchery:batchery [^&]*/files", rest), rest


def test_api_keys_and_settings_never_reach_a_worker(raw, compose):
    for name in BATCHERY_SERVICES:
        env = raw["services"][name]["environment"]
        leaked = sorted(k for k in env if k.startswith(API_PREFIX))
        assert not leaked, f"{name} gets batchery serve's settings: {leaked}"
    api = raw["services"]["api"]["environment"]
    worker = raw["services"]["worker"]["environment"]
    assert {k: v for k, v in api.items() if not k.startswith(API_PREFIX)} == worker  # the same broker, queue, model


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_images_install_the_serve_extra(dockerfile):
    runs = " ".join(rest for word, rest in dockerfile_instructions(ROOT / dockerfile) if word == "RUN")
    assert re.search(r"pip install '\.\[[^\]]*\bserve\b[^\]]*\]'", runs), "the image must have batchery[serve]"
    assert re.search(r"pip install '\.\[[^\]]*\bworker\b[^\]]*\]'", runs)


def test_gpu_replicas_and_cpu_replicas_share_one_env_and_redis(services):
    envs = [services[n]["environment"] for n in BATCHERY_SERVICES]
    assert all(e == envs[0] for e in envs), "worker, worker-cpu and cli must see the same BATCHERY_* settings"
    assert envs[0]["BATCHERY_BROKER_URL"] == "redis://redis:6379/0"


# -- configuration: .env reaches every setting -------------------------------------------------------
@pytest.mark.parametrize("name", BATCHERY_SERVICES)
def test_every_worker_setting_can_be_set_from_dot_env(raw, name):
    env = raw["services"][name]["environment"]
    missing = sorted(worker_setting_env_names() - set(env))
    assert not missing, (
        f"compose.yaml does not pass these settings to {name}; add them to x-batchery-env "
        f"(as `NAME:`, passed through from .env) and to .env.example: {missing}"
    )
    pending = set() if "send_events" in Settings.model_fields else {"BATCHERY_SEND_EVENTS"}
    unknown = sorted(
        {k for k in env if k.startswith("BATCHERY_")} - worker_setting_env_names() - COMPOSE_ONLY - pending
    )
    assert not unknown, f"compose.yaml sets variables no worker setting reads (typo, or an API key?): {unknown}"


def test_every_api_setting_can_be_set_from_dot_env(raw):
    env = raw["services"]["api"]["environment"]
    missing = sorted(setting_env_names() - API_FIXED_BY_COMMAND - set(env))
    assert not missing, f"compose.yaml does not pass these settings to the api service (x-api-env): {missing}"
    assert not API_FIXED_BY_COMMAND & set(env), "the api's command sets --host and --port; the env would mislead"
    pending = set() if "send_events" in Settings.model_fields else {"BATCHERY_SEND_EVENTS"}
    unknown = sorted({k for k in env if k.startswith("BATCHERY_")} - setting_env_names() - COMPOSE_ONLY - pending)
    assert not unknown, f"compose.yaml sets variables no Settings field reads (typo?): {unknown}"
    # the keys come from .env or the shell, never from this file
    assert env["BATCHERY_API__KEYS"] is None


def test_pass_through_settings_keep_the_worker_defaults(raw):
    env = raw["x-batchery-env"]
    fixed = {k for k, v in env.items() if v is not None}
    # only what compose must decide is set here; everything else comes from .env or the defaults
    assert fixed == {
        "BATCHERY_BROKER_URL",
        "BATCHERY_MODEL_CACHE",
        "BATCHERY_SHUTDOWN_GRACE",
        "BATCHERY_SEND_EVENTS",
        "BATCHERY_STORAGE_URL",  # the store volume, which workers, api and cli share
    }
    for k in fixed - {"BATCHERY_MODEL_CACHE"}:
        assert env[k].startswith(f"${{{k}:-"), f"{k} must be overridable from .env: {env[k]!r}"


def test_env_example_documents_every_variable(raw):
    entries = env_example_entries()
    used = referenced_variables(COMPOSE.read_text())
    for svc in raw["services"].values():
        env = svc.get("environment") or {}
        used |= {k for k, v in (env.items() if isinstance(env, dict) else []) if v is None}
    undocumented = sorted(used - set(entries))
    assert not undocumented, f".env.example does not mention {undocumented}"
    unknown = sorted(
        {k for k in entries if k.startswith("BATCHERY_")}
        - setting_env_names()
        - COMPOSE_ONLY
        - {"BATCHERY_SEND_EVENTS"}
    )
    assert not unknown, f".env.example names variables nothing reads: {unknown}"


def test_env_example_with_every_line_uncommented_is_a_valid_configuration(monkeypatch):
    entries = env_example_entries()
    empty = sorted(k for k, v in entries.items() if v == "")
    assert not empty, f"uncommenting these would pass an empty string to the worker: {empty}"
    for k in [k for k in os.environ if k.startswith("BATCHERY_")]:
        monkeypatch.delenv(k)
    for k, v in entries.items():
        if k in setting_env_names():
            monkeypatch.setenv(k, v)
    s = Settings()
    assert s.model == entries["BATCHERY_MODEL"]
    assert s.engine.kv_cache_memory == int(entries["BATCHERY_ENGINE__KV_CACHE_MEMORY"])
    assert s.shutdown_grace == float(entries["BATCHERY_SHUTDOWN_GRACE"])


def test_env_example_defaults_match_compose_and_settings(compose):
    entries = env_example_entries()
    env = compose["services"]["worker"]["environment"]
    assert entries["BATCHERY_SHUTDOWN_GRACE"] == env["BATCHERY_SHUTDOWN_GRACE"]
    assert entries["BATCHERY_STOP_GRACE_PERIOD"] == compose["services"]["worker"]["stop_grace_period"]
    assert entries["BATCHERY_BROKER_URL"] == env["BATCHERY_BROKER_URL"]
    for name in (
        "model",
        "dtype",
        "max_num_seqs",
        "task_timeout",
        "max_task_timeout",
        "max_retries",
        "watchdog_timeout",
        "health_port",
        "log_level",
    ):
        default = Settings.model_fields[name].default
        shown = entries[f"BATCHERY_{name.upper()}"]
        assert type(default)(shown) == default, f".env.example shows {name}={shown}, the default is {default}"


# -- flower and the cli ------------------------------------------------------------------------------
def test_flower_is_in_the_monitoring_profile_on_the_same_broker(services):
    flower = services["flower"]
    assert flower["profiles"] == ["monitoring"]
    assert "flower" in command_text(flower["command"])
    assert flower["environment"]["CELERY_BROKER_URL"] == services["worker"]["environment"]["BATCHERY_BROKER_URL"]
    assert flower["depends_on"]["redis"]["condition"] == "service_healthy"


def test_workers_send_task_events_for_flower(services):
    for name in ("worker", "worker-cpu"):
        assert services[name]["environment"]["BATCHERY_SEND_EVENTS"].lower() in ("1", "true", "yes")


@pytest.mark.xfail(
    "send_events" not in Settings.model_fields,
    strict=True,
    reason="worker Settings has no send_events field yet: BATCHERY_SEND_EVENTS is ignored",
)
def test_send_events_setting_exists():
    assert Settings.model_fields["send_events"].annotation in (bool, bool | None)


def test_cli_service_runs_batchery_against_the_stack(services):
    cli = services["cli"]
    assert set(cli["profiles"]) & {"cli", "tools"}
    assert cli["entrypoint"] in (["batchery"], "batchery")
    assert cli["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "deploy" not in cli  # no GPU for the CLI
    assert cli["healthcheck"] == {"disable": True}


# -- images ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_installs_the_project_as_a_non_root_user(dockerfile):
    instructions = dockerfile_instructions(ROOT / dockerfile)
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert re.search(r"pip install (--no-deps )?\.(\s|$)", runs), "the image must `pip install .` the project"
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{dockerfile} must end as a non-root user"
    assert "useradd" in runs
    health = [rest for word, rest in instructions if word == "HEALTHCHECK"]
    assert health and "batchery" in health[0] and "health" in health[0]
    cmd = [rest for word, rest in instructions if word in ("CMD", "ENTRYPOINT")]
    assert cmd and "batchery" in cmd[-1] and "worker" in cmd[-1]
    env = " ".join(rest for word, rest in instructions if word == "ENV")
    assert "BATCHERY_MODEL_CACHE=/models" in env  # where compose mounts the models volume
    assert "chown batchery:batchery /models" in runs  # so the non-root worker can fill it


def test_gpu_image_keeps_the_base_cuda_torch():
    runs = " ".join(rest for word, rest in dockerfile_instructions(ROOT / "Dockerfile") if word == "RUN")
    assert "base_torch" in runs and "torch.version.cuda" in runs  # the build fails if pip replaced it
    assert "gcc" in runs  # Triton compiles its launcher at run time


def test_dockerignore_sends_only_the_sources():
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    for path in (
        ".env",
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_worker.py",
        "results.jsonl",
        "engine/__pycache__/llm.cpython-311.pyc",
        ".cache/batchery/models/x.gguf",
    ):
        assert dockerignore_excludes(path, patterns), f"{path} would be sent to the docker build"
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        for word, rest in dockerfile_instructions(ROOT / dockerfile):
            if word == "COPY" and "--from" not in rest:
                for src in rest.split()[:-1]:
                    probe = src if (ROOT / src).is_file() else f"{src}/__init__.py"
                    assert (ROOT / probe).exists(), f"{dockerfile} copies {src}, which does not exist"
                    assert not dockerignore_excludes(probe, patterns), f".dockerignore drops {src} ({dockerfile})"
    # pyproject.toml's readme is read when the package is built
    assert not dockerignore_excludes("README.md", patterns)


def test_deploy_doc_covers_replicas_per_gpu_services_and_draining():
    doc = DEPLOY_DOC.read_text()
    assert "--scale worker=" in doc
    assert "device_ids" in doc
    assert "stop_grace_period" in doc and "BATCHERY_SHUTDOWN_GRACE" in doc
    assert "## Capacity" in doc


# -- docker-compose config -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(
                "docker-compose is not installed; CI must run `apt-get install -y docker-compose` "
                "(Debian's package validates compose files without a Docker engine)"
            )
        pytest.skip("docker-compose not installed (apt-get install -y docker-compose)")
    return exe


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of the deployment files in a clean directory: no stray .env changes the outcome."""
    for name in ("compose.yaml", "Dockerfile", "Dockerfile.cpu", ".env.example"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def run_config(exe: str, project: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHERY_", "REDIS_", "FLOWER_", "COMPOSE_"))}
    proc = subprocess.run([exe, *args, "config"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"docker-compose {' '.join(args)} config failed:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


def test_docker_compose_config_validates(docker_compose, project, compose):
    got = run_config(docker_compose, project, "-f", "compose.yaml")
    assert set(got["services"]) == set(compose["services"])
    worker = got["services"]["worker"]
    assert duration_s(worker["stop_grace_period"]) == duration_s(compose["services"]["worker"]["stop_grace_period"])
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert got["services"]["redis"]["ports"] == ["127.0.0.1:6379:6379/tcp"]
    # pass-through settings stay unset, so the worker's own defaults apply
    assert worker["environment"]["BATCHERY_MODEL"] is None
    api = got["services"]["api"]
    assert api["ports"] == ["127.0.0.1:8000:8000/tcp"]
    assert api["environment"]["BATCHERY_API__KEYS"] is None  # unset: batchery serve refuses 0.0.0.0, saying why
    assert api["environment"]["BATCHERY_API__STORAGE_DIR"] == "/files"
    assert api["command"] == ["batchery", "serve", "--host", "0.0.0.0", "--port", "8000"]


def test_docker_compose_config_validates_with_every_profile(docker_compose, project):
    got = run_config(
        docker_compose, project, "--profile", "cpu", "--profile", "monitoring", "--profile", "cli", "-f", "compose.yaml"
    )
    assert {"redis", "worker", "worker-cpu", "flower", "cli"} <= set(got["services"])


def test_docker_compose_config_takes_the_env_example_fully_uncommented(docker_compose, project):
    entries = env_example_entries()
    (project / "all.env").write_text("".join(f"{k}={v}\n" for k, v in entries.items()))
    got = run_config(docker_compose, project, "--env-file", "all.env", "-f", "compose.yaml")
    env = got["services"]["worker"]["environment"]
    assert env["BATCHERY_MODEL"] == entries["BATCHERY_MODEL"]
    assert env["BATCHERY_ENGINE__KV_CACHE_MEMORY"] == entries["BATCHERY_ENGINE__KV_CACHE_MEMORY"]
    assert got["services"]["worker"]["stop_grace_period"] == entries["BATCHERY_STOP_GRACE_PERIOD"]
    assert got["services"]["redis"]["ports"] == [f"127.0.0.1:{entries['REDIS_HOST_PORT']}:6379/tcp"]
    api = got["services"]["api"]
    assert api["environment"]["BATCHERY_API__KEYS"] == entries["BATCHERY_API__KEYS"]
    assert api["ports"] == [f"127.0.0.1:{entries['API_HOST_PORT']}:8000/tcp"]
    assert "BATCHERY_API__KEYS" not in got["services"]["worker"]["environment"]


def doc_compose_files() -> dict[str, str]:
    """The ```yaml blocks of docs/deploy.md that start with ``# file: NAME``."""
    blocks = re.findall(r"^( *)```yaml\n(.*?)^\1```", DEPLOY_DOC.read_text(), flags=re.S | re.M)
    files = {}
    for indent, body in blocks:
        body = "\n".join(line[len(indent) :] for line in body.splitlines()) + "\n"
        m = re.match(r"# file: (\S+)\n", body)
        if m:
            files[m.group(1)] = body
    return files


def test_deploy_doc_ships_the_override_files_it_describes():
    assert {"compose.gpus.yaml", "compose.redis-lan.yaml"} <= set(doc_compose_files())


@pytest.mark.parametrize("name", ["compose.gpus.yaml", "compose.redis-lan.yaml"])
def test_deploy_doc_override_files_validate(docker_compose, project, name):
    (project / name).write_text(doc_compose_files()[name])
    shutil.copy(ROOT / ".env.example", project / ".env")  # the doc's first step
    got = run_config(docker_compose, project, "-f", "compose.yaml", "-f", name)
    services = got["services"]
    # the base worker keeps exactly its one GPU
    assert services["worker"]["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    if name == "compose.gpus.yaml":
        extra = sorted(n for n in services if n.startswith("worker-gpu"))
        assert extra, "no per-GPU services"
        for i, n in enumerate(extra, start=1):
            assert services[n]["deploy"]["resources"]["reservations"]["devices"] == [
                {"driver": "nvidia", "device_ids": [str(i)], "capabilities": ["gpu"]}
            ], n
            assert services[n]["environment"]["BATCHERY_BROKER_URL"] == "redis://redis:6379/0"
            assert services[n]["depends_on"]["redis"]["condition"] == "service_healthy"
            assert duration_s(services[n]["stop_grace_period"]) == duration_s(services["worker"]["stop_grace_period"])
    else:
        for host_ip, _ in _published(services["redis"]["ports"]):
            assert host_ip not in (None, "", "0.0.0.0", "::"), services["redis"]["ports"]
