"""python -m target_service --model M --port P [--device D --dtype T]
[--draft-model D: host that draft too, its DraftService on the same port]"""
from batchspec.runtime import compute, service
from batchspec.v1 import draft_pb2_grpc, target_pb2_grpc
from target_service.servicer import SERVICE_NAME, TargetServicer

DEFAULT_PORT = 50052


def hosting(config: service.ServiceConfig):
    """(servicer class, build, warm, host) for the configured target (host: its draft)."""
    return (*service.model_hosting(TargetServicer)(config),
            host_draft if config.draft is not None else None)


def host_draft(config: service.ServiceConfig, runner, servicer: TargetServicer, gate):
    """The draft of config.draft, loaded and warmed, served beside the target: the same
    server, instance (gate) and compute thread, and the target runner's lock, so that a
    verify runs the draft's propose as part of its own command and no command of either
    service interleaves with it."""
    from draft_service import SERVICE_NAME as DRAFT_SERVICE
    from draft_service.servicer import DraftServicer

    draft_runner = compute.run(service.build_runner, config.draft)
    compute.run(service.warm_up, draft_runner, proposes=True)
    draft_runner.lock = runner.lock
    servicer.hosted_draft = DraftServicer(draft_runner, dtype=config.draft.dtype, gate=gate)
    return [(draft_pb2_grpc.add_DraftServiceServicer_to_server, servicer.hosted_draft,
             DRAFT_SERVICE)]


def main(argv=None):
    service.main("target", DEFAULT_PORT, hosting,
                 target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, argv)


if __name__ == "__main__":
    main()
