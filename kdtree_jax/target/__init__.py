"""The Kimi K2 / DeepSeek-V3 target model: pure functions over a plain params pytree."""
