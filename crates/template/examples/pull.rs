//! `cargo run -p cubicle-template --example pull -- STATE REF`: pull an image into a
//! state directory's layer store and print its layers (a manual check of `oci::pull`).

#![allow(clippy::expect_used)]

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (state, reference) = match args.as_slice() {
        [_, s, r] => (s.clone(), r.clone()),
        _ => {
            eprintln!("usage: pull STATE REF");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = cubicle_template::TemplateStore::open(std::path::Path::new(&state)).expect("store");
    let t0 = std::time::Instant::now();
    let log = |m: String| eprintln!("{m}");
    match rt.block_on(cubicle_template::oci::pull::pull(
        &store,
        &reference,
        None,
        &Default::default(),
        &log,
    )) {
        Ok(img) => println!(
            "{} layers in {:.2}s: {:?}",
            img.layers.len(),
            t0.elapsed().as_secs_f64(),
            img.layers
        ),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
