"""The pipeline: the studies' harness, params.yaml's schema, the registry of studies in experiments/, the generated
DVC stages, the reports and MLflow. It imports the library (adaattn); the library never imports it."""
