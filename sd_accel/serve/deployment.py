"""Ray Serve wiring: the model deployment (N replicas, each a ``ModelServer``), the HTTP ingress
(auth, validation, 503/504 mapping) and ``serve()``, which starts it all.

The ingress is its own light deployment (no CPU reserved) so that a bad or unauthorised request
is answered before it takes a place in a replica's queue, and so that a replica that dies under
a request gives the client an error, not a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from sd_accel.core import InvalidValue
from sd_accel.serve.app import Busy, Unavailable, build_app
from sd_accel.serve.batching import QueueFull
from sd_accel.serve.config import ServeConfig

log = logging.getLogger("sd_accel")

MODEL_DEPLOYMENT = "SdAccelModel"
INGRESS_DEPLOYMENT = "SdAccelIngress"
HEALTH_CHECK_PERIOD_S = 5.0
PROBE_TIMEOUT_S = 2.0  # /sd-accel/health waits this long for a replica's own health check
# The last --build-missing run in this process: the pid of the Ray worker that built (gone after).
LAST_BUILD: dict[str, int] = {}


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ImportError("sd-accel serve needs Ray Serve: pip install 'ray[serve]>=2.60,<3', or in the sd-accel "
                          "checkout pip install -e '.[serve]' (sd-accel is not on the package index)") from None
    return ray, serve


def _cause(exc: BaseException) -> BaseException:
    """The user exception inside a Ray task error (Ray re-raises it wrapped)."""
    return getattr(exc, "cause", None) or exc


class RayBackend:
    """``app.Backend`` over the model deployment's handle."""

    def __init__(self, handle, app_name: str) -> None:
        self.handle = handle
        self.app_name = app_name

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from ray import exceptions as rex
        from ray.serve import exceptions as sex

        response = self.handle.generate.remote(request)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()  # the client went away or timed out: free the replica's slot
            raise
        except sex.BackPressureError:
            raise Busy("every replica is busy and the queue is full; retry later") from None
        except (rex.RayActorError, sex.DeploymentUnavailableError, sex.ReplicaUnavailableError) as exc:
            raise Unavailable(
                f"the replica serving this request stopped ({type(exc).__name__}); Ray restarts it: retry"
            ) from None
        except rex.TaskCancelledError:
            raise Unavailable("the request was cancelled on the replica; retry") from None
        except Exception as exc:
            cause = _cause(exc)
            if isinstance(cause, QueueFull):
                raise Busy(str(cause)) from None
            if isinstance(cause, InvalidValue):
                raise InvalidValue(str(cause)) from None
            raise

    async def health(self) -> dict[str, Any]:
        _, serve = _ray()
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        deployment = app.deployments.get(MODEL_DEPLOYMENT) if app else None
        if deployment is None:
            return {"ok": False, "status": "not deployed", "replicas": {}}
        replicas = {getattr(k, "value", str(k)): v for k, v in deployment.replica_states.items()}
        state = {
            "ok": replicas.get("RUNNING", 0) > 0,
            "status": getattr(deployment.status, "value", str(deployment.status)),
            "replicas": replicas,
        }
        if state["ok"]:
            # Serve's status trails a replica's death by a health-check period: ask the replicas.
            state["answering"] = await self._answering()
            if not state["answering"]:
                state.update(ok=False, status="no replica answers its health check (one died; Ray replaces it)")
        return state

    async def _answering(self) -> int:
        """How many of the model's replicas answer their health check within PROBE_TIMEOUT_S.
        Called on the actors directly, not through the deployment's queue, so a busy replica
        still answers (its event loop is free while a batch runs in its worker thread)."""
        ray, _ = _ray()
        prefix = f"SERVE_REPLICA::{self.app_name}#{MODEL_DEPLOYMENT}#"
        actors = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        answered = 0
        for entry in actors:
            if not entry["name"].startswith(prefix):
                continue
            try:
                actor = ray.get_actor(entry["name"], namespace=entry.get("namespace") or "serve")
                await asyncio.wait_for(actor.check_health.remote(), PROBE_TIMEOUT_S)
                answered += 1
            except Exception:  # dead (RayActorError, gone from the registry), unhealthy or stuck
                continue
        return answered


class Ingress:
    """The HTTP ingress deployment's class: builds the FastAPI app on its replica."""

    def __init__(self, config: dict[str, Any], model) -> None:
        self.config = ServeConfig.from_dict(config)
        self.backend = RayBackend(model, self.config.app_name)

    def __serve_build_asgi_app__(self):
        self._asgi = build_app(self.config, self.backend)  # not "app": serve.ingress has that property
        return self._asgi

    async def drain(self, grace_s: float) -> dict[str, int]:
        """Shutdown's first step (``app.Lifecycle.drain``): called through the deployment's handle."""
        return await self._asgi.state.lifecycle.drain(grace_s)


def build_application(config: ServeConfig):
    """The Ray Serve application for ``config`` (pass it to ``serve.run``)."""
    _, serve = _ray()
    from sd_accel.serve.replica import ModelServer

    data = config.to_dict()
    model = serve.deployment(
        ModelServer,
        name=MODEL_DEPLOYMENT,
        num_replicas=config.num_replicas,
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        max_ongoing_requests=config.max_ongoing_requests,
        # The ingress admits at most this many (see app.build_app); Ray's own bound is a safety net.
        max_queued_requests=config.num_replicas * config.max_ongoing_requests + config.max_queued_requests,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=10,
    )
    # The ingress holds every request the replicas can hold and queue, plus room for the
    # health and engine routes; past that Ray's proxy answers 503 with Retry-After itself.
    ingress_room = config.num_replicas * config.max_ongoing_requests + config.max_queued_requests + 16
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=ingress_room,
        max_queued_requests=max(16, config.max_queued_requests),
        backpressure_config={"retry_after_s": config.retry_after_s},
    )
    return ingress.bind(data, model.bind(data))


def _build_task(data: dict[str, Any]) -> tuple[list[str], int]:
    """Runs on a Ray worker with a replica's resources: build the engines that are missing, the
    ControlNets of ``controlnet_dir`` and the UNet that takes their residuals included (a request's
    units then run on engines from its first call). Returns their names and the worker's pid."""
    from sd_accel import build_engines, load_pipeline, with_controlnets
    from sd_accel.api import residual_component
    from sd_accel.serve.controlnet_units import controlnet_files

    config = ServeConfig.from_dict(data)
    if config.num_cpus:
        os.environ.setdefault("SD_ACCEL_ORT_THREADS", str(max(1, int(config.num_cpus))))
    pipe = load_pipeline(config.model, allow_pickle=config.allow_pickle)
    profiles = build_profiles_for(config, pipe)
    common = dict(preset=config.build_preset if profiles is None else None, profiles=profiles,
                  backend=config.accel.backend, precision=config.build_precision, engine_dir=config.engine_dir,
                  progress=False)
    names = [r.name for r in build_engines(pipe, **common)]
    for label, path in controlnet_files(config.controlnet_dir).items():
        try:
            control = with_controlnets(pipe, [str(path)], allow_pickle=config.allow_pickle)
        except Exception as exc:  # a file that does not load fails its requests, not the service
            log.warning("sd-accel serve: ControlNet %s not built: %s", label, exc)
            continue
        # (the residual-taking UNet / transformer is the same for every ControlNet: built once,
        # then found in the cache)
        names += [r.name for r in build_engines(control, components=["controlnet", residual_component(pipe)],
                                                **common)]
    return list(dict.fromkeys(names)), os.getpid()


def build_profiles_for(config: ServeConfig, pipe) -> list[dict[str, Any]] | None:
    """The profiles ``--build-missing`` builds: ``build_profiles`` when given; with neither
    those nor ``build_preset``, the family's default preset with the batch range up to
    ``max_batch_size``, so that the batching the service is configured for can happen (a
    static batch-1 engine caps every call at one image). None: ``build_preset`` decides."""
    if config.build_profiles is not None or config.build_preset is not None:
        return config.build_profiles
    from sd_accel.profiles import default_preset, preset

    family = getattr(getattr(pipe, "sd_accel_model", None), "family", None) or (
        "sdxl" if hasattr(pipe, "text_encoder_2") else "sd15")
    base = preset(default_preset(family)).to_dict()
    if config.max_batch_size > 1:
        base["batch"] = [1, 1, config.max_batch_size]
    return [base]


def build_missing(config: ServeConfig) -> list[str]:
    """Build (or reuse) the engines of ``config`` once, on a node of the replicas' kind (same CPU
    and GPU request, so TensorRT engines match the replicas' GPUs), before any traffic."""
    ray, _ = _ray()
    # max_calls=1: the worker exits once the build returns. Ray otherwise keeps it in its pool,
    # holding the pipeline and the build's heap (0.7 GB for the tiny model) for the service's life.
    task = ray.remote(num_cpus=config.num_cpus, num_gpus=config.num_gpus, max_retries=0, max_calls=1)(_build_task)
    start = time.perf_counter()
    names, build_worker_pid = ray.get(task.remote(config.to_dict()))
    LAST_BUILD["worker_pid"] = build_worker_pid
    log.warning("sd-accel serve: %d engine(s) ready in %s (%.0f s)", len(names), config.engine_dir or "./engines",
                time.perf_counter() - start)
    return names


def init_ray(config: ServeConfig) -> bool:
    """Join ``config.address`` (or ``$RAY_ADDRESS``), else start a small local Ray, its ports on
    loopback unless ``config.host`` opens the service to the network. True: a local Ray was started."""
    ray, _ = _ray()
    if ray.is_initialized():
        return False
    address = config.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return False
    if not config.open_to_network:
        _local_ray_on_loopback()
    with _children_ignore_ctrl_c():
        ray.init(include_dashboard=False, object_store_memory=config.object_store_mb * 2**20)
    if not config.open_to_network:
        node = ray.util.get_node_ip_address()
        if not ipaddress.ip_address(node).is_loopback:
            log.warning("sd-accel serve: the local Ray's ports listen on %s, not only on this machine "
                        "(this Ray version ignores %s=0); a firewall should close them", node, _RAY_CLUSTER_ENV)
    return True


@contextlib.contextmanager
def _children_ignore_ctrl_c():
    """Start the local Ray with SIGINT ignored, which its processes (and the workers its raylet
    starts later: replicas, the controller) inherit. A terminal's Ctrl-C goes to the whole process
    group: the replicas and Serve's controller took it as their own and died mid-request (answers
    from a dead replica instead of the drain's, and once an exit that hung past 120 s), while the
    drain in ``shutdown`` needs them alive. Only this process acts on Ctrl-C; ``shutdown`` ends the rest."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# Ray's own switch (the default on macOS and Windows): a node that takes 127.0.0.1 as its address,
# so that the GCS, raylet, object manager and agents listen on loopback only. Its value is read
# when ray is imported (and by the processes Ray starts), hence both the variable and the constant.
_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _local_ray_on_loopback() -> None:
    os.environ[_RAY_CLUSTER_ENV] = "0"
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # another Ray layout: the check after ray.init says so
        pass


def resource_shortfall(config: ServeConfig, nodes: list[dict[str, Any]]) -> str | None:
    """Why the Ray cluster of ``nodes`` (``ray.nodes()``) cannot place ``config``'s replicas, or
    None when it can. Ray never fails such a request: it waits, saying only in its own log that
    no node type can fulfil it, so without this check the service would hang silently."""
    alive = [n.get("Resources") or {} for n in nodes if n.get("Alive", True)]

    def fits(resources: dict[str, Any]) -> int:
        room = []
        for need, have in ((config.num_cpus, resources.get("CPU", 0)), (config.num_gpus, resources.get("GPU", 0))):
            if need:
                room.append(int(have // need))
        return min(room) if room else config.num_replicas

    places = sum(fits(r) for r in alive)
    if places >= config.num_replicas:
        return None
    cpus = sum(r.get("CPU", 0) for r in alive)
    gpus = sum(r.get("GPU", 0) for r in alive)
    hints = []
    if config.num_gpus and not gpus:
        hints.append("this cluster has no GPU: leave --num-gpus out (or 0) to serve on CPUs")
    hints.append("ask for fewer --num-replicas, --num-cpus or --num-gpus, or join a bigger cluster with --address")
    return (f"sd-accel serve: {config.num_replicas} replica(s) of {config.num_cpus:g} CPU and {config.num_gpus:g} GPU "
            f"each do not fit the Ray cluster ({len(alive)} node(s), {cpus:g} CPU and {gpus:g} GPU in all; "
            f"{places} replica(s) fit), and Ray would wait for them forever: " + "; ".join(hints))


def check_resources(config: ServeConfig) -> None:
    """Refuse (``DeviceError``) a deployment the Ray cluster cannot place, before it is started.
    A cluster joined with ``--address`` may autoscale: there it is a warning that says what Ray waits for."""
    ray, _ = _ray()
    why = resource_shortfall(config, ray.nodes())
    if why is None:
        return
    if config.address or os.environ.get("RAY_ADDRESS"):
        log.warning("%s (if this cluster autoscales, Ray waits until a node that fits joins)", why)
        return
    from sd_accel.core import DeviceError

    raise DeviceError(why)


@dataclass
class Server:
    """A running ``sd-accel serve`` application."""

    url: str
    app_name: str

    def stats(self) -> dict[str, Any]:
        """One replica's stats (requests, calls and their sizes, UNet batches, engine use)."""
        _, serve = _ray()
        return serve.get_deployment_handle(MODEL_DEPLOYMENT, self.app_name).stats.remote().result()

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Remove the application (Ray and Serve keep running for others), after a drain: new
        requests get 503, running ones have ``grace_s`` to finish, the rest get 503."""
        _, serve = _ray()
        try:
            serve.get_deployment_handle(INGRESS_DEPLOYMENT, self.app_name).drain.remote(grace_s).result(
                timeout_s=grace_s + 15)
        except Exception as exc:  # the ingress is gone already: nothing to drain
            log.warning("sd-accel serve: could not drain the requests (%s); removing the application", exc)
        serve.delete(self.app_name)


def serve(config: ServeConfig | None = None, *, blocking: bool = True, **fields: Any) -> Server:
    """Start ``sd-accel serve``: Ray (joined or local), engines built when ``build_missing``,
    then the application on ``http://host:port``. ``fields`` are ``ServeConfig`` fields (used
    when ``config`` is None). With ``blocking`` it serves until Ctrl-C, then shuts Serve down.

    (Skipped in the test suite: it starts a Ray cluster and an HTTP server; tests/test_serve_ray.py
    does.)

    >>> server = serve(model="builtin:tiny-sd15", port=8000, blocking=False)  # doctest: +SKIP
    >>> server.url                                                          # doctest: +SKIP
    'http://127.0.0.1:8000'
    """
    if config is None:
        from sd_accel.serve.config import make_config

        config = make_config(**fields)
    elif fields:
        raise InvalidValue("give serve() a ServeConfig or its fields, not both")
    if config.open_to_network and not config.token:
        log.warning("sd-accel serve: listening on %s without a token: anyone who reaches it can generate; "
                    "set --token or SD_ACCEL_SERVE_TOKEN", config.host)
    if config.engine_dir is None:  # the replicas' working folder is Ray's, not ours: make it absolute
        from sd_accel import EngineCache

        config = dataclasses.replace(config, engine_dir=str(EngineCache(None).root))
    _, rserve = _ray()
    started_ray = init_ray(config)
    check_resources(config)
    if config.build_missing:
        build_missing(config)
    rserve.start(http_options={"host": config.host, "port": config.port})
    rserve.run(build_application(config), name=config.app_name, route_prefix="/", blocking=False)
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    server = Server(f"http://{host}:{config.port}", config.app_name)
    if blocking:
        # A shell starts a script's background jobs with SIGINT ignored (so that a Ctrl-C meant for
        # the foreground command spares them), and Python keeps it so: honour that, but say it.
        stop_with = "SIGTERM stops it (SIGINT is ignored: it was started so, as a background job)" \
            if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "Ctrl-C stops it"
        print(f"sd-accel serve: {config.model} on {server.url} "
              f"({config.num_replicas} replica(s), batch up to {config.max_batch_size}); {stop_with}", flush=True)
        # SIGTERM (what process managers send) takes the same way out as Ctrl-C.
        previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() \
            else None
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            try:
                shutdown(config, started_ray)
            finally:
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
    return server


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def shutdown(config: ServeConfig, stop_ray: bool) -> None:
    """Stop ``config``'s service without losing an answer: new requests get 503, running ones
    have ``shutdown_grace_s`` to finish and the rest get 503, then the application goes; with
    ``stop_ray`` (a local Ray this process started) Ray goes too, with every process it left
    (its agents ignore SIGTERM). A second Ctrl-C skips the wait."""
    ray, rserve = _ray()
    grace = config.shutdown_grace_s
    print(f"sd-accel serve: stopping: new requests get 503; running ones have {grace:g} s to finish", flush=True)
    try:
        handle = rserve.get_deployment_handle(INGRESS_DEPLOYMENT, config.app_name)
        done = handle.drain.remote(grace).result(timeout_s=grace + 15)
        print(f"sd-accel serve: {done['running'] - done['cut_short']} of {done['running']} running request(s) "
              f"finished, {done['cut_short']} answered 503", flush=True)
    except KeyboardInterrupt:
        print("sd-accel serve: interrupted again: stopping without waiting", flush=True)
    except Exception as exc:  # no ingress (it never started), Ray already going: stop anyway
        log.warning("sd-accel serve: could not drain the requests (%s); stopping", exc)
    leftovers = _descendants() if stop_ray else []
    try:
        rserve.shutdown()
    finally:
        if stop_ray:
            ray.shutdown()
            _end(leftovers)


def _descendants() -> list:
    """This process's descendants (psutil handles, which know a reused pid from the original)."""
    try:
        import psutil

        return psutil.Process().children(recursive=True)
    except Exception:  # no psutil (Ray brings it): Ray's own shutdown is all there is
        return []


def _end(processes: list, wait_s: float = 5.0) -> None:
    """End the processes of a local Ray still alive after ``ray.shutdown()``: SIGTERM, then SIGKILL."""
    if not processes:
        return
    import psutil

    alive = [p for p in processes if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=wait_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=wait_s)
