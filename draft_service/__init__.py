"""The draft service: hosts a draft (a model, or the model-free n-gram lookup) and proposes
tokens."""
SERVICE_NAME = "batchspec.v1.DraftService"
