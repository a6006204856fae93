//! Lets the built binaries, tests and benches find libtorch without `LD_LIBRARY_PATH`: torch-sys
//! reports the libtorch it linked against (`DEP_TCH_LIBTORCH_LIB`), and we record that
//! directory as an rpath.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
