"""The finance API: a read-only FastAPI app over the ledger (`costexporter api`, or `serve --api-port`)."""
