//! A guest of `trainhost:train@0.1.0`, the first release of the package:
//! the interface as it was then (the part this guest uses), so that a host
//! built against a later 0.1.x release is checked to still run it.

wit_bindgen::generate!({
    inline: r#"
        package trainhost:train@0.1.0;

        interface context {
            world-rank: func() -> u32;
        }

        interface session {
            variant metric-value {
                integer(s64),
                float(f64),
                text(string),
                boolean(bool),
            }
            record metric {
                name: string,
                value: metric-value,
            }
            variant report-error {
                invalid-checkpoint(string),
                invalid-metrics(string),
                collision(string),
            }
            report: func(metrics: list<metric>, checkpoint: option<string>) -> result<_, report-error>;
        }

        world trainer {
            import context;
            import session;
            export train: func() -> result<_, string>;
        }
    "#,
    world: "trainer",
});

use trainhost::train::session::{Metric, MetricValue, report};

struct Loop;

impl Guest for Loop {
    fn train() -> Result<(), String> {
        let rank = trainhost::train::context::world_rank();
        let metrics = [Metric {
            name: "rank".into(),
            value: MetricValue::Integer(i64::from(rank)),
        }];
        report(&metrics, None).map_err(|e| format!("{e:?}"))
    }
}

export!(Loop);
