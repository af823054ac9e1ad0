"""python -m draft_service --model M --port P [--device D --dtype T --num-layers N]"""
from batchspec import service
from batchspec.v1 import draft_pb2_grpc
from draft_service.servicer import SERVICE_NAME, DraftServicer

DEFAULT_PORT = 50053


def main(argv=None):
    service.main("draft", DEFAULT_PORT, DraftServicer,
                 draft_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME, argv)


if __name__ == "__main__":
    main()
