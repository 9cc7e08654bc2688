"""How the bundled models are built: corpus, tokenizer, training, distillation, model card,
acceptance measurement, and the tiny random models the tests and placeholders use. Nothing
that serves imports this package (placeholder models are built only when cluster.yaml asks
for them)."""
