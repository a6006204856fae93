//! Lets the built binaries, tests and benches find libtorch without `LD_LIBRARY_PATH`: torch-sys
//! reports the libtorch it linked against (`DEP_TCH_LIBTORCH_LIB`), and we record that
//! directory as an rpath.
//!
//! `EDGEMOE_RPATH` (a `:`-separated list) replaces that rpath: `deploy/build-aarch64.sh` sets it
//! to `$ORIGIN/lib`, so a packaged binary finds the libtorch libraries shipped beside it wherever
//! its directory is unpacked, and carries no path of the build machine.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=EDGEMOE_RPATH");
    let rpaths: Vec<String> = match std::env::var("EDGEMOE_RPATH") {
        Ok(list) if !list.trim().is_empty() => list
            .split(':')
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect(),
        _ => std::env::var("DEP_TCH_LIBTORCH_LIB").into_iter().collect(),
    };
    for dir in rpaths {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
