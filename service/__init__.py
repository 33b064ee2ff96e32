"""The torchyard API service: FastAPI app, SQL store, scheduler and artifact store."""
