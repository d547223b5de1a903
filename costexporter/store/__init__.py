"""Redis: the keyspace (one builder per key), the client factory, the protocol's entry encoding,
the event reader and the ledger's codec and transactions."""
