"""The Kafka backend: topics, clients, writer, readers, consumer group, access."""
