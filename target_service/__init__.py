"""The target service: hosts the target model and verifies drafts."""
