"""The deploy-function registry: steps a backend adds to, or replaces in, its deployment."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from mqbench.backends.registry import _key, resolve_backend
from mqbench.deploy.context import DeployStep
from mqbench.deploy.stepwise import BACKEND_DEPLOY_FUNCTION, wants_model_and_kwargs
from mqbench.deploy.writers import WRITERS

__all__ = ["DeployFunctionRegistry", "deploy_functions", "register_deploy_function"]


class DeployFunctionRegistry(Mapping[str, Mapping[str, DeployStep]]):
    """Backend name -> {artifact key: step}: steps a backend adds to, or replaces in, its deployment.

    A step may come with a reader (``read(path, spec, float_model) -> QParamTable``) so that
    :func:`~mqbench.deploy.verify.verify_deploy` checks the file it writes like a built-in one.
    """

    def __init__(self) -> None:
        self._steps: dict[str, dict[str, DeployStep]] = {}
        self._readers: dict[str, dict[str, Callable[..., Any]]] = {}

    def __getitem__(self, backend: Any) -> Mapping[str, DeployStep]:
        return dict(self._steps.get(_key(backend), {}))

    def __iter__(self) -> Iterator[str]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def register(
        self,
        backend: Any,
        artifact: str,
        step: DeployStep,
        replace: bool = False,
        reader: Callable[..., Any] | None = None,
    ) -> None:
        key = _key(backend)
        steps = self._steps.setdefault(key, {})
        # Taken: a step registered before, the two ONNX models, or a key the spec lists that a built-in writer makes.
        builtin = artifact in ("onnx", "deploy_onnx") or (artifact in _writer_keys(backend) and artifact in WRITERS)
        if (artifact in steps or builtin) and not replace:
            raise ValueError(f"backend {key!r} already produces {artifact!r}; pass replace=True to replace that step")
        steps[artifact] = step
        if reader is not None:
            self._readers.setdefault(key, {})[artifact] = reader
        else:
            self._readers.get(key, {}).pop(artifact, None)

    def reader(self, backend: Any, artifact: str) -> Callable[..., Any] | None:
        """The reader registered with a step, or None."""
        return self._readers.get(_key(backend), {}).get(artifact)

    def unregister(self, backend: Any, artifact: str) -> None:
        self._steps.get(_key(backend), {}).pop(artifact, None)
        self._readers.get(_key(backend), {}).pop(artifact, None)


deploy_functions = DeployFunctionRegistry()


def _writer_keys(backend: Any) -> tuple[str, ...]:
    try:
        return resolve_backend(backend).deploy
    except ValueError:
        return ()


def register_deploy_function(
    backend: Any, artifact: str | None = None, replace: bool = False, reader: Callable[..., Any] | None = None
) -> Callable[[DeployStep], DeployStep]:
    """Decorator: ``step(context) -> path`` produces the artifact ``artifact`` (default: the function's name).

    A function written MQBench's way, ``fn(model, **kwargs)``, is appended to the backend's
    ``BACKEND_DEPLOY_FUNCTION`` list instead and called by ``convert_deploy`` after its own steps,
    with MQBench's keyword arguments (see :mod:`mqbench.deploy.stepwise`).

    A key the backend already produces needs ``replace=True``; a key its spec lists that no
    built-in writer makes does not. ``reader(path, spec, float_model) -> QParamTable`` lets
    ``verify_deploy`` check the file. Example:
    ``@register_deploy_function("tensorrt", "summary")`` then ``def summary(ctx): ...``.
    """

    def decorate(step: DeployStep) -> DeployStep:
        if artifact is None and reader is None and wants_model_and_kwargs(step):
            # MQBench's form, fn(model, **kwargs): run in registration order after the pipeline's own steps
            BACKEND_DEPLOY_FUNCTION.append(backend, step)
            return step
        deploy_functions.register(backend, artifact or step.__name__, step, replace, reader)
        return step

    return decorate
