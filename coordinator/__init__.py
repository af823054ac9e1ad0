"""The coordinator: request pool, ragged bookkeeping, and the draft -> verify -> commit loop.
Plain Python over integers and token lists: nothing here imports torch."""
