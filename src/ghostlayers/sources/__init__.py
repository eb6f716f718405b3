"""Where text, zero-shot tasks and bundled models come from: fetching registry packages once, and parsing
them into corpora, lm-eval task folders and model folders. The numerical core (calibration, operators,
surgery, pipeline) never imports this package: it sees token windows and models, not their origin."""
