"""The OTLP pipeline: provider, transport, encoders, the span processor, spool, metrics, shipper, replay."""
