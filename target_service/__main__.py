"""python -m target_service --model M --port P [--device D --dtype T]"""
from batchspec.runtime import service
from batchspec.v1 import target_pb2_grpc
from target_service.servicer import SERVICE_NAME, TargetServicer

DEFAULT_PORT = 50052


def main(argv=None):
    service.main("target", DEFAULT_PORT, service.model_hosting(TargetServicer),
                 target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, argv)


if __name__ == "__main__":
    main()
