"""One Kafka node: its config, jars, image, container, daemon and entry point."""
