"""python -m draft_service --model M --port P [--device D --dtype T --num-layers N]
(--model ngram: the model-free prompt-lookup draft, which never imports torch;
--target-tokenizer T: a draft of another tokenizer, proposing the target's tokens)"""
from batchspec.ngram import NGRAM_MODEL
from batchspec.runtime import service
from batchspec.v1 import draft_pb2_grpc
from draft_service import SERVICE_NAME

DEFAULT_PORT = 50053


def hosting(config: service.ServiceConfig):
    """(servicer class, build, warm) for the configured draft."""
    if config.model == NGRAM_MODEL:
        if config.target_tokenizer:
            raise SystemExit("--target-tokenizer is for a draft model of another tokenizer; "
                             "the n-gram draft reads the target's tokens as they are")
        from draft_service import ngram_servicer
        return ngram_servicer.NgramServicer, ngram_servicer.build_store, ngram_servicer.warm_up
    if config.target_tokenizer:
        from draft_service import translating
        return (translating.TranslatingServicer, translating.build_runner,
                translating.warm_up)
    from draft_service.servicer import DraftServicer
    return service.model_hosting(DraftServicer, proposes=True)(config)


def main(argv=None):
    service.main("draft", DEFAULT_PORT, hosting, draft_pb2_grpc.add_DraftServiceServicer_to_server,
                 SERVICE_NAME, argv)


if __name__ == "__main__":
    main()
