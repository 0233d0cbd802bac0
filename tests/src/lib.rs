//! Harness for end-to-end tests.
