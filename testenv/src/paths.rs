//! The workspace root, cargo's target directory, and the Envoy binary inside a virtualenv.

use std::{
    env,
    path::{Path, PathBuf},
};

/// The workspace root (the parent of this crate's folder).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the testenv crate lives in the workspace")
        .to_path_buf()
}

/// Cargo's target directory: `CARGO_TARGET_DIR` (relative paths taken from the current directory, as
/// cargo does) or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                env::current_dir().expect("a current directory").join(dir)
            }
        }
        _ => workspace_root().join("target"),
    }
}

/// The Envoy binary inside a virtualenv made by `cargo xtask envoy`
/// (`<venv>/lib/python3.*/site-packages/envoy/_bin/envoy`), if there is one.
pub fn venv_envoy_binary(venv: &Path) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
        .map(|entry| entry.path().join("site-packages/envoy/_bin/envoy"))
        .filter(|path| path.is_file())
        .collect();
    candidates.sort();
    candidates.pop()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_envoy_binary_in_a_venv() {
        let venv = tempfile::tempdir().unwrap();
        assert_eq!(venv_envoy_binary(venv.path()), None);
        let bin = venv.path().join("lib/python3.13/site-packages/envoy/_bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("envoy"), "").unwrap();
        assert_eq!(venv_envoy_binary(venv.path()), Some(bin.join("envoy")));
    }

    #[test]
    fn the_workspace_root_holds_the_workspace_manifest() {
        assert!(workspace_root().join("Cargo.toml").is_file());
        assert!(workspace_root().join("testenv").is_dir());
    }
}
