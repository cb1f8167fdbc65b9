"""What is stored and how: shards, ledgers, manifests, indexes, recipes, reasons, storage, locks."""
