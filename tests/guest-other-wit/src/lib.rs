//! A guest of a future, incompatible `trainhost:train` package version.

wit_bindgen::generate!({
    inline: r#"
        package trainhost:train@0.9.0;

        interface context {
            world-rank: func() -> u32;
        }

        world trainer {
            import context;
            export train: func() -> result<_, string>;
        }
    "#,
    world: "trainer",
});

struct Loop;

impl Guest for Loop {
    fn train() -> Result<(), String> {
        let _ = trainhost::train::context::world_rank();
        Ok(())
    }
}

export!(Loop);
