"""Ray, imported on first use, and the one call every side makes to the parameter servers: a
method on each of them at once, with a timeout, a dead or silent server raised as
`LostParameterServer`. Imported by the coordinator's modules and, in a worker process, by
`worker_side` alike, so it depends on none of them."""

from __future__ import annotations

from mirrax import errors

# Seconds a worker waits for the parameter servers' answer to one pull or push. A server
# that is alive but does not answer is as lost as a dead one.
PARAMETER_SERVER_TIMEOUT_S = 60.0


class LostParameterServer(Exception):
    """Raised on a worker when a parameter server is dead or does not answer in time."""


def import_ray():
    """The `ray` module, imported on first use (mirrax imports without Ray installed).

    Raises:
      MissingDependencyError: Ray is not installed (the message gives the pip command).
    """
    try:
        import ray
    except ImportError:
        raise errors.MissingDependencyError(
            "ParameterServerStrategy runs on Ray, which is not installed. Install it with "
            "`pip install 'mirrax[ray]'` (or `pip install ray`)."
        ) from None
    return ray


def call_servers(servers: list, method: str, per_server_args: list, timeout_s: float) -> list:
    """`method(*args)` on every parameter server at once; their answers, in server order.

    Used by the coordinator and by the workers alike.

    Raises:
      LostParameterServer: a server is dead, or did not answer within `timeout_s` seconds.
    """
    ray = import_ray()
    refs = [getattr(ps, method).remote(*args) for ps, args in zip(servers, per_server_args)]
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LostParameterServer(
            f"a parameter server did not answer a {method} within {timeout_s:.0f} s"
        ) from None
    except ray.exceptions.RayActorError as e:
        raise LostParameterServer(f"a parameter server died during a {method}: {e}") from None
